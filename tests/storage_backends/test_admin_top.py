"""`hicache-admin top --once` against a real server: tenants, bytes, hit rate, ops/s and
latency percentiles of the interval; and the server's /metrics label hygiene under load."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

from storage_backends.server.admin_top import quantile
from tests.metrics_names import check_bounded, check_exposition
from tests.procs import free_port
from tests.storage_backends.hicache_server_proc import HiCacheServerProc
from tests.storage_backends.test_hicache_admin import (
    CAPACITY,
    NS_A,
    NS_B,
    TOKEN,
    admin,
    client,
    keys_of,
    prompt,
    write,
)


def scrape(port: int) -> str:
    """The server's /metrics (waiting for its exporter to listen: it starts after the data
    port)."""
    for _ in range(200):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                return r.read().decode()
        except urllib.error.URLError:
            time.sleep(0.05)
    raise AssertionError(f"no /metrics on port {port}")


def test_top_once_shows_tenants_rates_and_latency(tmp_path: Path) -> None:
    mport = free_port()
    srv = HiCacheServerProc(tmp_path, capacity=CAPACITY, metrics_port=mport,
                            args=["--admin-token", TOKEN]).start()
    try:
        before = scrape(mport)
        for ns, salt in ((NS_A, 1), (NS_B, 2)):
            b = client(srv.url, ns)
            keys = keys_of(prompt(salt, 3), ns)
            write(b, ns, keys)
            assert b.batch_exists(keys) == 3
            b.close()
        r = admin(srv.url, "top", "--once", "--interval", "0.2",
                  "--metrics-url", f"http://127.0.0.1:{mport}/metrics")
        assert r.returncode == 0, r.stderr
        out = r.stdout
        assert NS_A[:16] in out and NS_B[:16] in out
        for col in ("tenant", "bytes", "hit rate", "gets/s", "evictions", "p50 ms", "p99 ms"):
            assert col in out, col
        after = scrape(mport)
        check_exposition(after, bounded_ids=("namespace",))
        check_bounded(before, after, allow_new=("namespace", "tier", "op", "code", "path", "dir"))
    finally:
        srv.stop()


def test_quantile_of_the_interval() -> None:
    before = {0.001: 10.0, 0.01: 10.0, float("inf"): 10.0}
    after = {0.001: 10.0, 0.01: 19.0, float("inf"): 20.0}
    assert quantile(0.5, before, after) == 0.01
    assert quantile(0.99, before, after) == float("inf")
    assert quantile(0.5, after, after) is None
