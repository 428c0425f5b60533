"""The pytest stand-in of scripts/gpu_check.sh (the GPU machine has no pytest), run on CPU.

The `gpu` tests run there once, through that stand-in: it must import every gpu test module,
expand parametrizations, resolve the fixtures the tests take (conftest.py fixtures such as
`checkpoint_factory`, `tmp_path`, `monkeypatch`) and count failures, or the one GPU run is lost.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def standin_source() -> str:
    text = SCRIPT.read_text()
    m = re.search(r"<<'PYEOF'\n(.*?)\nPYEOF\n", text, re.S)
    assert m is not None
    return m.group(1)


def run_standin(cwd: Path, files: list[str], mark: str = "gpu") -> subprocess.CompletedProcess:
    env = dict(os.environ, GPU_CHECK_MARK=mark, PYTHONPATH=str(ROOT),
               HF_HUB_OFFLINE="1", LMCACHE_TRACK_USAGE="false")
    return subprocess.run([sys.executable, "-", *files], input=standin_source(), cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


CONFTEST_TOP = '''
import os
import pytest
import torch

@pytest.fixture(scope="session")
def session_value():
    return ["session"]

@pytest.fixture(autouse=True, scope="session")
def _marker_env():
    os.environ["STANDIN_AUTOUSE"] = "1"
'''

TEST_A = '''
import os
import pytest
import torch

pytest.importorskip("json", reason="json is there")
CALLS = []

@pytest.fixture(scope="module")
def counted(session_value):
    CALLS.append("module")
    yield session_value + ["module"]
    CALLS.append("teardown")

@pytest.fixture
def per_test(tmp_path):
    return tmp_path / "x"

@pytest.mark.gpu
@pytest.mark.parametrize("a", [1, 2])
@pytest.mark.parametrize(("b", "c"), [(3, 4), pytest.param(5, 6, marks=pytest.mark.skip(reason="p"))])
def test_params(a, b, c, counted, per_test, monkeypatch):
    assert counted == ["session", "module"] and CALLS == ["module"]
    assert os.environ["STANDIN_AUTOUSE"] == "1"
    assert not per_test.exists() and per_test.parent.is_dir()
    monkeypatch.setenv("STANDIN_ENV", str(a))
    monkeypatch.setattr(os, "sep", "#")
    assert (a, b, c) in ((1, 3, 4), (2, 3, 4))

@pytest.mark.gpu
def test_undone_and_helpers(monkeypatch, tmp_path_factory):
    assert "STANDIN_ENV" not in os.environ and os.sep == "/"
    monkeypatch.delenv("STANDIN_AUTOUSE")
    assert tmp_path_factory.mktemp("d").is_dir()
    assert 0.1 + 0.2 == pytest.approx(0.3) and [1.0, 2.0] == pytest.approx([1.0, 2.0 + 1e-9])
    assert 1.0 != pytest.approx(1.1, rel=0.01)
    with pytest.raises(ValueError, match="bad th"):
        raise ValueError("a bad thing")
    pytest.importorskip("no_such_module_xyz", reason="skipped on purpose")

@pytest.mark.gpu
@pytest.mark.skipif(True, reason="condition")
def test_skipif():
    raise AssertionError("must not run")

@pytest.mark.gpu
def test_fails():
    assert 1 == 2

def test_not_marked():
    raise AssertionError("must not run")
'''

TEST_CKPT = '''
import pytest
import torch

@pytest.mark.gpu
def test_checkpoint(checkpoint_factory):
    path = checkpoint_factory("llama", with_tokenizer=False, layers=1)
    assert (path / "config.json").is_file()
    assert checkpoint_factory("llama", with_tokenizer=False, layers=1) == path
'''


def test_standin_runs_marked_tests_with_fixtures(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    sub = tests / "engine"
    sub.mkdir(parents=True)
    (tests / "__init__.py").write_text("")
    (sub / "__init__.py").write_text("")
    (tests / "conftest.py").write_text(CONFTEST_TOP)
    # The real engine conftest (checkpoint_factory, the demo-model dir, one torch thread).
    shutil.copy(ROOT / "tests" / "engine" / "conftest.py", sub / "conftest.py")
    (sub / "test_a.py").write_text(TEST_A)
    (sub / "test_ckpt.py").write_text(TEST_CKPT)
    (sub / "test_broken.py").write_text("import no_such_module_abc\n")
    (sub / "test_modskip.py").write_text(
        "import pytest\npytest.importorskip('no_such_module_def', reason='gone')\n")
    files = [f"tests/engine/{n}.py" for n in ("test_a", "test_ckpt", "test_broken",
                                              "test_modskip")]
    res = run_standin(tmp_path, files)
    out = res.stdout
    lines = [ln for ln in out.splitlines() if ln.split(" ")[0] in ("PASSED", "FAILED", "SKIPPED")]
    assert lines == [  # test functions by name; the innermost parametrize varies slowest
        "FAILED tests/engine/test_a.py::test_fails",
        "PASSED tests/engine/test_a.py::test_params{'b': 3, 'c': 4, 'a': 1}",
        "PASSED tests/engine/test_a.py::test_params{'b': 3, 'c': 4, 'a': 2}",
        "SKIPPED tests/engine/test_a.py::test_params{'b': 5, 'c': 6, 'a': 1}: p",
        "SKIPPED tests/engine/test_a.py::test_params{'b': 5, 'c': 6, 'a': 2}: p",
        "SKIPPED tests/engine/test_a.py::test_skipif: condition",
        # Skipped at its last line: everything before it held.
        "SKIPPED tests/engine/test_a.py::test_undone_and_helpers: skipped on purpose",
        "PASSED tests/engine/test_ckpt.py::test_checkpoint",
        "FAILED tests/engine/test_broken.py: cannot import",
        "SKIPPED tests/engine/test_modskip.py: gone",
    ], out + res.stderr
    assert "3 passed, 2 failed, 5 skipped" in out
    assert res.returncode == 1


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="a CPU check: with CUDA the gpu tests run for real (gpu_check's gpu_tests step)")
def test_standin_imports_every_gpu_test_module_on_cpu() -> None:
    """The real gpu test modules import under the stand-in (on CPU every gpu test is skipped by
    its skipif, none fails, none is missing)."""
    # The files the script picks: every test module with a `gpu`-marked test.
    assert "GPU_TESTS=$(grep -rl --include='test_*.py' 'mark.gpu' tests" in SCRIPT.read_text()
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if "mark.gpu" in p.read_text())
    assert "tests/hicache/test_stream_order.py" in files
    res = run_standin(ROOT, files)
    out = res.stdout
    assert res.returncode == 0, out + res.stderr
    assert "FAILED" not in out and " 0 failed" in out
    skipped = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]
    assert all(ln.endswith(("needs a CUDA device", "needs exactly one GPU")) for ln in skipped), skipped
    ran = {ln.split("::")[1].split("{")[0].split(":")[0] for ln in skipped}
    assert {"test_capture_and_replay_equal_eager", "test_gpu_round_trip_is_bit_exact",
            "test_gpu_layerwise_load_gives_the_same_logits", "test_gpu_round_trip_all_tiers",
            "test_gpu_layerwise_forward_waits_per_layer",
            "test_forward_reads_each_layer_only_after_its_slowed_load",
            "test_all_tiers_bit_exact_with_every_copy_slowed"} <= ran


def test_suite_report_lists_each_failure_with_its_first_line(tmp_path: Path) -> None:
    """scripts/gpu_report.py (the suites step's plugin) under pytest-xdist: one line per test,
    written by the controller only, and a summary of counts, failures and skip reasons."""
    pytest.importorskip("xdist")
    (tmp_path / "test_mixed.py").write_text(
        "import pytest\n"
        "def test_ok():\n    assert 1\n"
        "def test_bad():\n    x = 2\n    assert x == 3, 'two is not three'\n"
        "@pytest.mark.skip(reason='needs redis-server')\ndef test_skip():\n    pass\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('no device')\n"
        "def test_error(broken):\n    pass\n")
    report = tmp_path / "report.tsv"
    env = {**os.environ, "GPU_REPORT": str(report),
           "PYTHONPATH": f"{ROOT / 'scripts'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run([sys.executable, "-m", "pytest", "-p", "gpu_report", "-p", "no:cacheprovider",
                    "-n", "2", "-q", "-o", "addopts=", "test_mixed.py"],
                   cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_report.py"), str(report)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert res.stdout.splitlines() == [
        "1 error, 1 failed, 1 passed, 1 skipped",
        "FAILED test_mixed.py::test_bad",  # (by test id, whatever order they finished in)
        "    AssertionError: two is not three",
        "ERROR test_mixed.py::test_error",
        "    RuntimeError: no device",
        "skip reasons:",
        "     1  needs redis-server",
    ]
