"""Load held: 8 client processes x 60 s of mixed get / set / exists against a real
hicache-server and a real redis-server at the same time (benchmarks/soak_storage.py): zero
errors, every page read back is bit-identical, and every page written (none is evicted: the
servers have room) reads back bit-identical afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.storage_backends.redis_servers import HAVE_REDIS, SKIP_REASON

REPO = Path(__file__).resolve().parents[2]
SECONDS = 60
PROCESSES = 8


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.skipif(not HAVE_REDIS, reason=SKIP_REASON)
def test_soak_hicache_server_and_redis(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak_storage", "--targets", "hicache,redis",
         "--soak-processes", str(PROCESSES), "--soak-seconds", str(SECONDS),
         "--soak-parallel-targets", "--tmp", str(tmp_path / "servers"), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=SECONDS + 400,
    )
    assert out.exists(), r.stderr[-4000:]
    rows = {row["target"]: row for row in json.loads(out.read_text())["results"]["soak"]}
    assert sorted(rows) == ["hicache", "redis"], r.stdout
    for name, row in rows.items():
        assert row["clients"] == PROCESSES
        assert row["errors"] == 0, (name, row["error_samples"])
        assert row["mismatches"] == 0, name
        assert (row["pages_missing"], row["pages_wrong"]) == (0, 0), name
        assert row["pages_checked"] > 0
        assert min(row["get_ops"], row["set_ops"], row["exists_ops"]) > 0, name
        assert row["ok"]
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
