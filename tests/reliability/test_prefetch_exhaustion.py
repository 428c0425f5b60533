"""The host pool exhausted while storage prefetches are in flight: later prefetches are not
started, cancelled ones are revoked, admission takes what arrived, and when everything settles
no host or device page has leaked (`check_integrity`) and every page loaded is the right KV."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence

import torch

from hicache.memory_backend import MemoryBackend
from hicache_client.backend import StorageConfig
from tests.hicache.factories import run_request, tensor_cache

PAGE = 4
PROMPT_PAGES = 8


class GatedBackend(MemoryBackend):
    """The reference in-process backend whose reads wait for a gate: it keeps prefetches in
    flight for as long as a test needs."""

    def __init__(self, shared: str) -> None:
        super().__init__(StorageConfig(extra={"shared": shared}))
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Semaphore(0)

    def _get_into(self, keys: Sequence[str], out: Sequence[memoryview]) -> list[int]:
        if not self.gate.is_set():
            self.waiting.release()
            assert self.gate.wait(60), "gate never opened"
        return super()._get_into(keys, out)


def prompt(i: int) -> list[int]:
    return [1000 * (i + 1) + j for j in range(PROMPT_PAGES * PAGE)]


def test_host_pool_exhausted_with_prefetches_in_flight() -> None:
    shared = f"exhaustion-{uuid.uuid4().hex}"
    # A writer cache (same namespace: same dtype, page size and layout) puts six prompts in L3.
    writer = tensor_cache(page_size=PAGE, device_pages=64, host_pages=64,
                          storage=MemoryBackend(StorageConfig(extra={"shared": shared})))
    kv: dict[int, torch.Tensor] = {}
    with writer:
        wpool = writer.device_pool
        assert wpool is not None
        for i in range(6):
            pages, _ = run_request(writer, prompt(i), rid=f"w{i}", fill=True)
            kv[i] = wpool.kv[:, :, wpool.slots(pages)].clone()
        writer.flush()
        assert writer.storage_stats().stored_pages == 6 * PROMPT_PAGES  # type: ignore[union-attr]
    backend = GatedBackend(shared)
    # Prefetches may take the whole host pool here (the default caps them at half of it).
    cache = tensor_cache(page_size=PAGE, device_pages=64, host_pages=2 * PROMPT_PAGES,
                         storage=backend, synchronous=False, prefetch_max_host_share=1.0)
    try:
        pool = cache.device_pool
        assert pool is not None

        backend.gate.clear()
        started = [cache.prefetch(f"r{i}", prompt(i)) for i in range(6)]
        # Every prefetch asks L3 (on the prefetch worker). Host pages are reserved as the answers
        # are applied: two prefetches fill the host pool, the others find no room.
        assert started == [PROMPT_PAGES * PAGE] * 6
        deadline = time.monotonic() + 30
        while cache.usage()["pending_prefetches"] != 2:
            assert time.monotonic() < deadline, "the L3 probes were never answered"
            cache.poll()
            time.sleep(0.002)
        use = cache.usage()
        assert (use["host_pages_free"], use["host_inflight_pages"]) == (0, 2 * PROMPT_PAGES)
        assert use["pending_prefetches"] == 2
        assert backend.waiting.acquire(timeout=30)  # a read is parked at the gate
        cache.check_integrity(outside_device_pages=0)

        # Meanwhile a new request computes its KV: the host pool has no room for its backup.
        fresh = [7] * (4 * PAGE)
        run_request(cache, fresh, rid="fresh")
        cache.poll()
        assert cache.stats.backup_skipped_tokens > 0
        cache.check_integrity(outside_device_pages=0)

        # r1 goes away mid-flight; r0 is admitted before any page arrived (best effort).
        cache.cancel_prefetch("r1")
        acq = cache.acquire(prompt(0), request_id="r0")
        assert acq.storage_hit_tokens == 0
        cache.release(acq.node)
        cache.check_integrity(outside_device_pages=0)

        backend.gate.set()
        cache.flush(timeout=60)
        cache.check_integrity(outside_device_pages=0)
        st = cache.stats
        # r0's pages arrived after its admission and were dropped. (r1 was cancelled before the
        # single prefetch worker reached it: its reserved pages were freed unread, uncounted.)
        assert st.prefetch_revoked_pages == PROMPT_PAGES
        # Four probes found no host room; the fresh request's prefetch had no allowance left.
        assert st.prefetch_skipped == 5
        use = cache.usage()
        assert (use["host_inflight_pages"], use["pending_prefetches"]) == (0, 0)
        assert use["host_pages_free"] + use["host_cached_tokens"] // PAGE == 2 * PROMPT_PAGES

        # The pool has room again: a prefetch completes and loads exactly the stored KV.
        assert cache.prefetch("again", prompt(2)) == PROMPT_PAGES * PAGE
        cache.flush(timeout=60)
        acq = cache.acquire(prompt(2), request_id="again")
        assert acq.storage_hit_tokens == PROMPT_PAGES * PAGE
        assert torch.equal(pool.kv[:, :, pool.slots(acq.device_pages)], kv[2])
        cache.release(acq.node)
        cache.flush(timeout=60)
        cache.check_integrity(outside_device_pages=0)
        cache.reset()
        cache.check_integrity(outside_device_pages=0)
        assert cache.host_alloc.num_free == 2 * PROMPT_PAGES
        assert cache.device_alloc.num_free == 64
        assert all(t.is_alive() for t in cache.controller._threads)
    finally:
        backend.gate.set()
        cache.close()


def test_default_share_keeps_half_the_host_pool_free_of_prefetches() -> None:
    """With the default `prefetch_max_host_share` (0.5) prefetches never take more than half
    the host pool, however many are asked: one 8-page prefetch fits in 16 host pages, the
    other five (probe answered, or not started for lack of allowance) take nothing."""
    shared = f"exhaustion-share-{uuid.uuid4().hex}"
    writer = tensor_cache(page_size=PAGE, device_pages=64, host_pages=64,
                          storage=MemoryBackend(StorageConfig(extra={"shared": shared})))
    with writer:
        for i in range(6):
            run_request(writer, prompt(i), rid=f"w{i}", fill=True)
        writer.flush()
    backend = GatedBackend(shared)
    cache = tensor_cache(page_size=PAGE, device_pages=64, host_pages=2 * PROMPT_PAGES,
                         storage=backend, synchronous=False)
    try:
        backend.gate.clear()
        for i in range(6):
            cache.prefetch(f"r{i}", prompt(i))
        deadline = time.monotonic() + 30
        while cache.usage()["pending_prefetches"] != 1:
            assert time.monotonic() < deadline, "the L3 probes were never answered"
            cache.poll()
            time.sleep(0.002)
        assert backend.waiting.acquire(timeout=30)  # the one fetch is parked at the gate
        use = cache.usage()
        assert (use["host_pages_free"], use["host_inflight_pages"]) == (PROMPT_PAGES,
                                                                          PROMPT_PAGES)
        cache.check_integrity(outside_device_pages=0)
        backend.gate.set()
        cache.flush(timeout=60)
        (rid,) = cache.prefetcher.pending  # the one that got host pages, until admitted
        i = int(rid[1:])
        acq = cache.acquire(prompt(i), request_id=rid)
        assert acq.storage_hit_tokens == PROMPT_PAGES * PAGE
        cache.release(acq.node)
        use = cache.usage()
        assert (use["host_inflight_pages"], use["pending_prefetches"]) == (0, 0)
        assert (cache.stats.prefetch_started, cache.stats.prefetch_skipped) == (1, 5)
        cache.check_integrity(outside_device_pages=0)
    finally:
        backend.gate.set()
        cache.close()
