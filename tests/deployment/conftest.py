"""Fixtures of the deployment tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Build the demo model in a temp dir, never in the user's ~/.cache (as tests/engine)."""
    if "HICACHE_DEMO_MODEL_DIR" not in os.environ:
        os.environ["HICACHE_DEMO_MODEL_DIR"] = str(tmp_path_factory.mktemp("demo") / "model")
