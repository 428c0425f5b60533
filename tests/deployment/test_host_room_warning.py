"""An engine on L3 whose host pool is not larger than its device pool says so at start-up: L3
prefetches land in free host pages, and with write-through every device page has a host copy, so
such an engine finds prefetch room only while its device pool has free pages (SGLang refuses the
configuration). Real engine processes, one file store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.engine.test_server_api import EngineServer

pytestmark = pytest.mark.slow

WARNING = "is not larger than the device pool"


def _engine(tmp: Path, name: str, ratio: str) -> str:
    flags = ["--enable-hierarchical-cache", "--hicache-ratio", ratio,
             "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
             json.dumps({"path": str(tmp / "pages")})]
    e = EngineServer(tmp, flags, name=name)
    try:
        e.start().wait_ready()
        assert e.get("/hicache/stats")["storage_backend"] == "file"
    finally:
        e.stop()
    return e.proc.log()


def test_equal_pools_warn_and_a_larger_host_pool_does_not(tmp_path: Path) -> None:
    log = _engine(tmp_path, "equal", "1.0")
    assert WARNING in log
    assert "--hicache-ratio above 1" in log
    assert WARNING not in _engine(tmp_path, "larger", "2.0")
