"""An L3 server SIGKILLed in the middle of a write burst, then restarted: the engine keeps
serving from L1/L2 during the outage, re-attaches by itself when the server is back, no
background thread dies, storage hits resume, and every output equals caching off."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.engine import Engine
from tests.procs import ManagedProcess, free_port, wait_for_port
from tests.reliability import conftest as rel
from tests.storage_backends.hicache_server_proc import HiCacheServerProc
from tests.storage_backends.mooncake_procs import ENV as MOONCAKE_ENV
from tests.storage_backends.mooncake_procs import master_binary
from tests.storage_backends.mooncake_procs import skip_reason as mooncake_skip_reason
from tests.storage_backends.redis_servers import (
    HAVE_REDIS,
    SKIP_REASON,
    RedisServer,
    RestartableServer,
)

pytestmark = pytest.mark.slow


def _kill_during_writes(engine: Engine, kill: Callable[[], object]) -> threading.Thread:
    """A thread that SIGKILLs the server as soon as the engine's first L3 writes went out."""

    def run() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            st = engine.cache.storage_stats()
            if st is not None and st.set_pages > 0:
                break
            time.sleep(0.001)
        kill()

    t = threading.Thread(target=run, name="killer")
    t.start()
    return t


def _failures(engine: Engine) -> int:
    """Every way a backend failure is counted: backend errors, controller errors, failed
    writes."""
    s = engine.cache_stats()
    return int(s["storage"]["errors"]) + int(s["storage_errors"]) + int(s["storage_failed_pages"])


def outage_cycle(engine: Engine, reference: rel.Reference, kill: Callable[[], object],
                 restart: Callable[[], object], seed: int, resume_timeout: float = 90.0) -> None:
    burst = rel.make_prompts(24, seed)
    killer = _kill_during_writes(engine, kill)
    reference.assert_matches(engine, burst)
    killer.join()
    # The outage: new prompts are computed, repeated ones come from L1/L2; nothing from L3.
    l3_hits = rel.stat(engine, "storage_hit_tokens")
    during = rel.make_prompts(8, seed + 1)
    reference.assert_matches(engine, during)
    reference.assert_matches(engine, burst[:8])
    assert rel.stat(engine, "device_hit_tokens") > 0
    engine.wait_transfers(120)
    reference.assert_matches(engine, during)
    assert rel.stat(engine, "storage_hit_tokens") == l3_hits
    assert _failures(engine) > 0, "the outage was not counted"
    assert all(rel.threads_alive(engine)) and len(rel.threads_alive(engine)) == 3
    engine.cache.check_integrity(outside_device_pages=0)

    restart()
    # Re-attached with no help: pages written now are read back from L3 after L1/L2 are dropped.
    deadline = time.monotonic() + resume_timeout
    attempt = 0
    while True:
        attempt += 1
        fresh = rel.make_prompts(8, seed + 100 + attempt)
        reference.assert_matches(engine, fresh)
        rel.settle(engine)
        before = rel.stat(engine, "storage_hit_tokens")
        reference.assert_matches(engine, fresh)
        if rel.stat(engine, "storage_hit_tokens") > before:
            break
        assert time.monotonic() < deadline, "storage hits never resumed after the restart"
        time.sleep(0.5)
    # Pages that were in L3 before the crash and are there again are served intact.
    rel.settle(engine)
    reference.assert_matches(engine, burst)
    assert rel.storage_stat(engine, "corrupt_pages") == 0
    assert all(rel.threads_alive(engine)) and len(rel.threads_alive(engine)) == 3
    engine.wait_transfers(120)
    engine.cache.check_integrity(outside_device_pages=0)


def test_hicache_server_killed_mid_write_burst(tmp_path: Path, tiny_model: Path,
                                               reference: rel.Reference) -> None:
    srv = HiCacheServerProc(tmp_path).start()
    try:
        extra = {"url": srv.url, "timeout_ms": 500}
        with rel.storage_engine(tiny_model, "hicache", extra) as engine:
            outage_cycle(engine, reference, srv.kill, srv.start, seed=10)
            assert rel.storage_stat(engine, "errors") > 0
    finally:
        srv.stop()


def test_hicache_server_with_persistence_keeps_pages_over_a_kill(
    tmp_path: Path, tiny_model: Path, reference: rel.Reference
) -> None:
    """With --persist-dir, pages that reached the disk before the SIGKILL are served after the
    restart (the write-behind queue's tail is lost; nothing served is corrupt)."""
    srv = HiCacheServerProc(tmp_path, persist_dir=tmp_path / "persist").start()
    try:
        extra = {"url": srv.url, "timeout_ms": 500}
        prompts = rel.make_prompts(8, 20)
        with rel.storage_engine(tiny_model, "hicache", extra) as engine:
            reference.assert_matches(engine, prompts)
            rel.settle(engine)
            time.sleep(1.0)  # the server's write-behind thread reaches the disk
            srv.kill()
            srv.start()
            before = rel.stat(engine, "storage_hit_tokens")
            deadline = time.monotonic() + 60
            while rel.stat(engine, "storage_hit_tokens") == before:
                assert time.monotonic() < deadline, "persisted pages never served"
                reference.assert_matches(engine, prompts)
                rel.settle(engine)
                time.sleep(0.2)
            assert rel.storage_stat(engine, "corrupt_pages") == 0
            assert all(rel.threads_alive(engine))
    finally:
        srv.stop()


@pytest.mark.redis
@pytest.mark.skipif(not HAVE_REDIS, reason=SKIP_REASON)
def test_redis_server_killed_mid_write_burst(tmp_path: Path, tiny_model: Path,
                                             reference: rel.Reference) -> None:
    server = RedisServer(tmp_path / "redis").start()
    try:
        extra = {"url": server.url, "socket_timeout": 0.5, "backoff_max_s": 1.0}
        with rel.storage_engine(tiny_model, "redis", extra) as engine:
            outage_cycle(engine, reference, server.kill, server.start, seed=30)
    finally:
        server.stop()


class MooncakeMaster(RestartableServer):
    """`mooncake_master` that can be SIGKILLed and started again on the same port."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__()
        binary = master_binary()
        assert binary is not None
        self.port, metrics = free_port(), free_port()
        self.argv = [
            binary,
            f"--rpc_port={self.port}",
            "--rpc_address=127.0.0.1",
            f"--metrics_port={metrics}",
            "--metrics_host=127.0.0.1",
            "--enable_metric_reporting=false",
            "--enable_http_metadata_server=false",
        ]
        self.log_dir = log_dir

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.starts += 1
        self.proc = ManagedProcess(self.argv, self.log_dir / f"master-{self.starts}.log",
                                   env=MOONCAKE_ENV).start()
        wait_for_port(self.port, proc=self.proc.proc)


@pytest.fixture
def mooncake_master_proc(tmp_path: Path) -> Iterator[MooncakeMaster]:
    reason = mooncake_skip_reason()
    if reason:
        pytest.skip(reason)
    m = MooncakeMaster(tmp_path)
    m.start()
    try:
        yield m
    finally:
        m.stop()


@pytest.mark.mooncake
def test_mooncake_master_killed_mid_write_burst(
    mooncake_master_proc: MooncakeMaster, tiny_model: Path, reference: rel.Reference,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for k, v in MOONCAKE_ENV.items():
        monkeypatch.setenv(k, v)
    extra: dict[str, Any] = {
        "master_server_address": mooncake_master_proc.address,
        "global_segment_size": 64 << 20,
        "local_buffer_size": 16 << 20,
        "staging_bytes": 4 << 20,
        "staging_buffers": 2,
    }
    m = mooncake_master_proc
    with rel.storage_engine(tiny_model, "mooncake", extra) as engine:
        outage_cycle(engine, reference, m.kill, m.start, seed=40)
