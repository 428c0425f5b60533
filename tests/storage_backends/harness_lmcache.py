"""Contract harness for `lmcache`: a real LMCache standalone server (`lmcache_server`) on a free
loopback port; every backend object is another client of it."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.procs import ManagedProcess, free_port, wait_for_port
from tests.storage_backends.harness import BackendFactory, Harness, closing_factory, config

ENV = {"LMCACHE_TRACK_USAGE": "false"}


def lmcache_skip_reason() -> str | None:
    try:
        import lmcache  # noqa: F401
    except ImportError as e:
        return f"lmcache is not installed ({e}): pip install 'hicache[lmcache]'"
    return None


def server_argv(port: int) -> list[str]:
    """`lmcache_server 127.0.0.1 PORT cpu` (the console script of lmcache 0.5.x)."""
    script = shutil.which("lmcache_server") or str(Path(sys.executable).parent / "lmcache_server")
    if Path(script).exists():
        return [script, "127.0.0.1", str(port), "cpu"]
    return [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"]


@contextmanager
def lmcache_server(log_dir: Path, port: int | None = None) -> Iterator[str]:
    """Start an LMCache server on loopback; yield its URL lm://127.0.0.1:PORT."""
    port = port or free_port()
    with ManagedProcess(server_argv(port), log_dir / f"lmcache_server-{port}.log", env=ENV) as p:
        wait_for_port(port, proc=p.proc, timeout=60)
        yield f"lm://127.0.0.1:{port}"


@contextmanager
def _start(tmp: Path) -> Iterator[BackendFactory]:
    from storage_backends.lmcache_backend import LMCacheBackend

    with (
        lmcache_server(tmp) as url,
        closing_factory(lambda **extra: LMCacheBackend(config({"url": url, **extra}))) as f,
    ):
        yield f


HARNESS = Harness(name="lmcache", start=_start, marks=[pytest.mark.lmcache],
                  skip_reason=lmcache_skip_reason)
