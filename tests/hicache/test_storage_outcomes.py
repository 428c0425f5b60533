"""Where every storage hit went (issue 31): each token L3 held when a request's prefetch asked
(`storage_probed_tokens`) comes to exactly one outcome (`CacheStats.storage_hit_outcomes`), and
the outcomes of a run sum to the tokens probed. One scenario per outcome, exact counts."""

from __future__ import annotations

import threading

import pytest
import torch

from hicache.memory_backend import MemoryBackend
from hicache.stats import STORAGE_HIT_OUTCOMES
from hicache_client.backend import StorageConfig
from tests.hicache.factories import tensor_cache
from tests.hicache.test_prefetch_policies import TOKENS, seeded, wait_for

PREFIX = list(range(900, 916))  # 4 pages of 4 in front of TOKENS


def store(shared: str, tokens: list[int]) -> None:
    """Put `tokens`' pages into the shared in-memory L3 (through a cache that computed them)."""
    writer = tensor_cache(synchronous=True,
                          storage=MemoryBackend(StorageConfig(extra={"shared": shared})))
    pages = writer.alloc_device(len(tokens) // 4)
    pool = writer.device_pool
    pool.kv[:, :, pool.slots(pages)] = torch.randn(pool.kv[:, :, pool.slots(pages)].shape)
    writer.insert(tokens, pages)
    writer.close()


def reader(shared: str, **cfg):
    backend = MemoryBackend(StorageConfig(extra={"shared": shared}))
    return tensor_cache(synchronous=True, storage=backend, **cfg), backend


def prefetched(shared: str, tokens: list[int] = TOKENS, **cfg):
    """A reader of `shared` whose prefetch of `tokens` (request "r") has read them all."""
    store(shared, tokens)
    cache, backend = reader(shared, **cfg)
    assert cache.prefetch("r", tokens) == 32
    cache.flush()
    return cache


def outcomes(cache) -> dict[str, int]:
    """The non-zero outcomes, after checking they sum to the tokens probed."""
    st = cache.stats
    assert set(st.storage_hit_outcomes) == set(STORAGE_HIT_OUTCOMES)
    assert sum(st.storage_hit_outcomes.values()) == st.storage_probed_tokens
    return {k: v for k, v in st.storage_hit_outcomes.items() if v}


def admit(cache, tokens: list[int], rid: str = "r"):
    acq = cache.acquire(tokens, request_id=rid)
    cache.release(acq.node)
    cache.flush()
    return acq


def test_reused() -> None:
    cache = prefetched("o-reused")
    acq = admit(cache, TOKENS)
    assert acq.storage_hit_tokens == 32
    assert outcomes(cache) == {"reused": 32}
    assert cache.stats.storage_probed_tokens == 32


def test_below_threshold() -> None:
    """The gap (32 tokens) was worth asking about; what L3 had (8) was under the floor."""
    store("o-below", TOKENS[:8])
    cache, _ = reader("o-below", prefetch_threshold=16)
    assert cache.prefetch("r", TOKENS) == 32
    cache.flush()
    admit(cache, TOKENS)
    assert outcomes(cache) == {"below_threshold": 8}


class GatedExists(MemoryBackend):
    """The in-memory backend with a gate in front of `batch_exists` (a test double on top of
    the real backend): the test decides when L3 answers a probe."""

    def __init__(self, shared: str) -> None:
        super().__init__(StorageConfig(extra={"shared": shared}))
        self.entered = threading.Event()
        self.gate = threading.Event()

    def batch_exists(self, keys):
        self.entered.set()
        assert self.gate.wait(10), "test never opened the gate"
        return super().batch_exists(keys)


def test_host_capacity() -> None:
    """Two requests asked L3 at once; the prefetch share of the host pool (8 pages) held the
    first one's 8 pages, none of the second's."""
    other = list(range(700, 732))
    store("o-host", TOKENS)
    store("o-host", other)
    backend = GatedExists("o-host")
    cache = tensor_cache(storage=backend, prefetch_max_host_share=8 / 32,
                         prefetch_policy="wait_complete")
    assert cache.prefetch("r", TOKENS) == cache.prefetch("r2", other) == 32  # (both asked)
    backend.gate.set()
    cache.flush()
    assert admit(cache, TOKENS).storage_hit_tokens == 32
    assert admit(cache, other, "r2").storage_hit_tokens == 0
    assert outcomes(cache) == {"reused": 32, "host_capacity": 32}
    cache.close()


def test_recomputed_by_cost_model() -> None:
    """Recomputing was measured far faster than reading L3: nothing is read."""
    store("o-cost", TOKENS)
    cache, _ = reader("o-cost")
    cost = cache.controller.cost
    assert cost is not None
    for _ in range(8):
        cost.observe_prefill(100_000, 0.001)
        cost.observe_load("host", 1_000, 1.0)
        cost.observe_load("storage", 1_000, 1.0)
    cache.prefetch("r", TOKENS)
    cache.flush()
    assert admit(cache, TOKENS).storage_hit_tokens == 0
    assert outcomes(cache) == {"recomputed_by_cost_model": 32}


def test_device_capacity() -> None:
    """Read into host memory, but the device pool has no room to load them for the request."""
    cache = prefetched("o-dev")
    held = cache.alloc_device(10)  # 6 of 16 pages left; the request needs 8
    assert admit(cache, TOKENS).storage_hit_tokens == 0
    assert outcomes(cache) == {"device_capacity": 32}
    cache.free_device(held)


def test_timeout() -> None:
    """best_effort: admitted with 3 of 8 pages read; the other 5 came too late."""
    cache, backend = seeded("o-timeout", prefetch_policy="best_effort")
    cache.prefetch("r", TOKENS)
    backend.gate.release(3)
    wait_for(lambda: cache.prefetch_progress("r")[0] == 3 or cache.poll() < 0)
    acq = cache.acquire(TOKENS, request_id="r")
    assert acq.storage_hit_tokens == 12
    cache.release(acq.node)
    backend.gate.release(8)  # the blocked read ends; the stopped prefetch reads no more
    cache.flush()
    assert outcomes(cache) == {"reused": 12, "timeout": 20}
    cache.close()


def test_probe_answered_after_admission_is_a_timeout() -> None:
    """The request was admitted while L3 was still being asked which pages it has."""
    store("o-probe", TOKENS)
    backend = GatedExists("o-probe")
    cache = tensor_cache(storage=backend, prefetch_policy="best_effort")
    cache.prefetch("r", TOKENS)
    assert backend.entered.wait(10)  # the worker is asking L3
    acq = cache.acquire(TOKENS, request_id="r")
    assert acq.storage_hit_tokens == 0
    cache.release(acq.node)
    backend.gate.set()
    cache.flush()
    assert outcomes(cache) == {"timeout": 32}
    cache.close()


@pytest.mark.parametrize(("damage", "outcome"), [("delete", "read_failed"),
                                                  ("corrupt", "corrupt")])
def test_read_stops_at_a_bad_page(damage: str, outcome: str) -> None:
    """L3 said it held 8 pages; page 5 was then deleted (or corrupted) before the read."""
    cache, backend = seeded("o-" + damage)  # reads wait at the backend's gate
    cache.prefetch("r", TOKENS)
    wait_for(lambda: cache.prefetch_progress("r")[1] == 8 or cache.poll() < 0)  # reading
    key = cache.prefetcher.pending["r"].keys[5]
    if damage == "delete":
        backend.delete([key])
    else:
        data = backend._store.data
        raw = bytearray(data[key])
        raw[-1] ^= 0x40
        data[key] = bytes(raw)
    backend.gate.release(8)
    cache.flush()
    assert admit(cache, TOKENS).storage_hit_tokens == 20
    assert outcomes(cache) == {"reused": 20, outcome: 12}
    cache.close()


def test_evicted_before_use() -> None:
    """The prefix the pages extend (on the device only, never backed up) was evicted between
    the prefetch and the admission: the pages read have nothing to attach to."""
    store("o-evict", PREFIX + TOKENS)
    cache, _ = reader("o-evict", write_policy="write_through_selective",
                      write_through_threshold=100)
    cache.insert(PREFIX, cache.alloc_device(4))
    assert cache.prefetch("r", PREFIX + TOKENS) == 32  # the tail only
    cache.flush()
    assert cache.evict(1000) == 16  # the prefix, gone from the tree
    acq = admit(cache, PREFIX + TOKENS)
    assert acq.storage_hit_tokens == 0
    assert outcomes(cache) == {"evicted_before_use": 32}


def test_already_cached() -> None:
    """Another request computed the same tokens while they were being read."""
    cache = prefetched("o-dup")
    other = cache.acquire(TOKENS)  # no prefetch of its own: computes all 8 pages
    assert other.device_hit_tokens == 0
    cache.insert(TOKENS, cache.alloc_device(8))
    cache.release(other.node)
    acq = admit(cache, TOKENS)
    assert acq.device_hit_tokens == 32 and acq.storage_hit_tokens == 0
    assert outcomes(cache) == {"already_cached": 32}


def test_cancelled() -> None:
    cache = prefetched("o-cancel")
    cache.cancel_prefetch("r")
    cache.flush()
    assert outcomes(cache) == {"cancelled": 32}
    cache.check_integrity(0)
