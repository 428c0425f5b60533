"""ruff and mypy stay clean on the typed packages (configured in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tool", ["ruff", "mypy"])
def test_clean(tool):
    # A missing tool is a failure, not a skip: a lint test that cannot run cannot fail either.
    assert shutil.which(tool, path=str(Path(sys.executable).parent)) is not None, (
        f"{tool} is not installed next to {sys.executable} (pip install -e '.[test]')"
    )
    exe = str(Path(sys.executable).parent / tool)
    argv = [exe, "check", "hicache", "storage_backends"] if tool == "ruff" else [exe]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
