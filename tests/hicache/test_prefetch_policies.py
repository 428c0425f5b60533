"""Prefetch policies and L3 failures on the threaded controller.

The backend here is the real in-memory backend with a gate in front of its reads (a test double
used *in addition to* the real-backend tests in tests/storage_backends), so the tests control
exactly how many pages have arrived when the scheduler looks.
"""

from __future__ import annotations

import threading
import time

import torch

from hicache.memory_backend import MemoryBackend
from hicache_client.backend import StorageConfig
from hicache_client.errors import StorageUnavailable
from tests.hicache.factories import tensor_cache

TOKENS = list(range(500, 532))  # 8 pages of 4


class GatedBackend(MemoryBackend):
    def __init__(self, shared: str) -> None:
        super().__init__(StorageConfig(extra={"shared": shared}))
        self.gate = threading.Semaphore(0)
        self.down = False

    def _get_into(self, keys, out):
        assert self.gate.acquire(timeout=10), "test never opened the gate"
        return super()._get_into(keys, out)

    def batch_exists(self, keys):
        if self.down:
            raise StorageUnavailable("connection refused")
        return super().batch_exists(keys)

    def batch_set(self, keys, values):
        if self.down:
            raise StorageUnavailable("connection refused")
        return super().batch_set(keys, values)


def seeded(shared: str, **cfg):
    """A cache whose L3 holds TOKENS, and a fresh cache (empty L1/L2) on the same store."""
    writer = tensor_cache(synchronous=True,
                          storage=MemoryBackend(StorageConfig(extra={"shared": shared})))
    pages = writer.alloc_device(8)
    pool = writer.device_pool
    pool.kv[:, :, pool.slots(pages)] = torch.randn(pool.kv[:, :, pool.slots(pages)].shape)
    writer.insert(TOKENS, pages)
    writer.close()
    backend = GatedBackend(shared)
    reader = tensor_cache(storage=backend, storage_batch_pages=1, **cfg)
    return reader, backend


def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def test_best_effort_takes_what_has_arrived():
    cache, gate = seeded("be", prefetch_policy="best_effort")
    assert cache.prefetch("r", TOKENS) == 32
    gate.gate.release(3)
    wait_for(lambda: cache.prefetch_progress("r")[0] == 3)
    assert cache.prefetch_ready("r")
    acq = cache.acquire(TOKENS, request_id="r")
    assert acq.storage_hit_tokens == 12  # 3 pages arrived; the rest is computed
    gate.gate.release(8)  # let the worker finish its current batch and stop
    cache.release(acq.node)
    cache.flush()
    cache.check_integrity(0)
    assert cache.usage()["host_inflight_pages"] == 0
    cache.close()


def test_wait_complete_waits_for_every_page():
    cache, gate = seeded("wc", prefetch_policy="wait_complete")
    cache.prefetch("r", TOKENS)
    gate.gate.release(7)
    wait_for(lambda: cache.prefetch_progress("r")[0] == 7)
    assert not cache.prefetch_ready("r")
    gate.gate.release(1)
    wait_for(lambda: cache.prefetch_ready("r"))
    acq = cache.acquire(TOKENS, request_id="r")
    assert acq.storage_hit_tokens == 32
    cache.release(acq.node)
    cache.flush()
    cache.check_integrity(0)
    cache.close()


def test_timeout_gives_up_after_budget():
    cache, gate = seeded("to", prefetch_policy="timeout", prefetch_timeout_base=0.2,
                         prefetch_timeout_per_ki_token=0.0)
    cache.prefetch("r", TOKENS)
    gate.gate.release(2)
    wait_for(lambda: cache.prefetch_progress("r")[0] == 2)
    wait_for(lambda: cache.prefetch_ready("r"))  # the budget runs out with 6 pages missing
    acq = cache.acquire(TOKENS, request_id="r")
    assert acq.storage_hit_tokens == 8
    gate.gate.release(8)
    cache.release(acq.node)
    cache.flush()
    cache.check_integrity(0)
    cache.close()


def test_dead_backend_degrades_to_l1_l2_and_recovers():
    cache, backend = seeded("dead", storage_retry_backoff=0.05)
    backend.down = True
    assert cache.prefetch("r", TOKENS) == 32  # asked; the worker's exists query raises
    cache.flush()
    assert cache.stats.storage_errors == 1 and cache.prefetch_progress("r") == (0, 0)
    assert cache.usage()["host_inflight_pages"] == 0 and cache.usage()["pending_prefetches"] == 0
    pages = cache.alloc_device(8)
    cache.insert(TOKENS, pages)  # write-through to host works; the L3 write fails, counted
    cache.flush()
    st = cache.stats
    assert st.storage_errors >= 1 and st.backup_tokens == 32
    usage = cache.usage()
    assert usage["transfer_threads_alive"] == 3 and usage["storage_down"] == 1
    backend.down = False
    time.sleep(0.1)  # past the back-off
    cache.evict(1000)
    cache.evict_host(1000)
    backend.gate.release(8)
    assert cache.prefetch("r2", TOKENS) == 32
    cache.flush()
    acq = cache.acquire(TOKENS, request_id="r2")
    assert acq.storage_hit_tokens == 32
    cache.release(acq.node)
    cache.check_integrity(0)
    cache.close()
