"""Which L3 gaps are prefetched (`Prefetcher.worth_prefetching`).

An explicit `prefetch_threshold` is a hard floor. Left unset (the default), the floor is 256
tokens (SGLang's default), and a shorter gap is prefetched when the cost model's measurements
say loading it saves at least `PREFETCH_MIN_SAVING_S` over recomputing it. The caches here are
real (tensor pools, a real in-memory L3 backend, synchronous transfers); the prefill speed the
cost model uses is fed through `observe_prefill`, the call the engine's scheduler makes after
each prefill forward."""

from __future__ import annotations

import pytest
import torch

from hicache.config import DEFAULT_PREFETCH_THRESHOLD, HiCacheConfig
from hicache.costmodel import CostModel
from hicache.memory_backend import MemoryBackend
from hicache.prefetch import PREFETCH_MIN_SAVING_S
from hicache_client.backend import StorageConfig
from hicache_client.errors import ConfigError
from tests.hicache.factories import tensor_cache

PS = 4
STORED = list(range(1000, 1016))  # 16 tokens = 4 pages: far below 256


def stored_cache(name: str, **cfg):
    """A cache whose L3 holds the 4 pages of STORED (written by an earlier cache on the same
    shared store), and nothing of it on device or host."""
    writer = tensor_cache(storage=MemoryBackend(StorageConfig(extra={"shared": name})),
                          synchronous=True, page_size=PS)
    pages = writer.alloc_device(len(STORED) // PS)
    pool = writer.device_pool
    pool.kv[:, :, pool.slots(pages)] = torch.randn(pool.kv[:, :, pool.slots(pages)].shape)
    expected = pool.kv[:, :, pool.slots(pages)].clone()
    writer.insert(STORED, pages)
    writer.flush()
    assert writer.stats.storage_backup_pages == 4
    writer.close()
    cache = tensor_cache(storage=MemoryBackend(StorageConfig(extra={"shared": name})),
                         synchronous=True, page_size=PS, **cfg)
    return cache, expected


def serve(cache, rid: str, tokens: list[int]) -> tuple[int, int, torch.Tensor | None]:
    """prefetch, then acquire: (tokens asked of L3, storage hit tokens, the KV acquired)."""
    asked = cache.prefetch(rid, tokens)
    cache.flush()
    acq = cache.acquire(tokens, request_id=rid)
    pool = cache.device_pool
    kv = pool.kv[:, :, pool.slots(acq.device_pages)].clone() if acq.device_pages else None
    hits = acq.storage_hit_tokens
    cache.release(acq.node)
    return asked, hits, kv


def test_default_threshold_is_unset_and_validated():
    assert HiCacheConfig().prefetch_threshold is None
    assert DEFAULT_PREFETCH_THRESHOLD == 256
    assert HiCacheConfig(prefetch_threshold=0).prefetch_threshold == 0
    with pytest.raises(ConfigError):
        HiCacheConfig(prefetch_threshold=-1)


def test_small_gap_is_skipped_while_prefill_is_unmeasured():
    cache, _ = stored_cache("gap-unmeasured", prefetch_threshold=None)
    assert serve(cache, "r", STORED)[:2] == (0, 0)
    assert cache.stats.prefetch_skipped == 1
    assert cache.stats.prefetch_started == 0
    cache.close()


def test_small_gap_is_loaded_when_the_cost_model_says_it_saves_time():
    cache, expected = stored_cache("gap-slow-prefill", prefetch_threshold=None)
    # A prefill of 16 tokens/s: the 16-token gap costs 1 s to compute, loading it far less.
    cache.controller.observe_prefill(16, 1.0)
    asked, hits, kv = serve(cache, "r", STORED)
    assert (asked, hits) == (16, 16)
    assert cache.stats.prefetch_started == 1
    assert cache.stats.storage_hit_tokens == 16
    assert kv is not None and torch.equal(kv, expected)  # the bytes L3 held, unchanged
    cache.close()


def test_small_gap_is_skipped_when_prefill_is_fast():
    cache, _ = stored_cache("gap-fast-prefill", prefetch_threshold=None)
    cache.controller.observe_prefill(1_000_000, 1.0)  # 16 tokens: 16 us to compute
    assert serve(cache, "r", STORED)[:2] == (0, 0)
    assert cache.stats.prefetch_skipped == 1
    cache.close()


def test_explicit_threshold_is_a_hard_floor():
    cache, _ = stored_cache("gap-explicit-256", prefetch_threshold=256)
    cache.controller.observe_prefill(16, 1.0)  # loading would save ~1 s: still not asked
    assert serve(cache, "r", STORED)[:2] == (0, 0)
    assert cache.stats.prefetch_skipped == 1
    cache.close()
    cache, expected = stored_cache("gap-explicit-16", prefetch_threshold=16)
    cache.controller.observe_prefill(1_000_000, 1.0)  # fast prefill, but 16 >= the floor
    asked, hits, kv = serve(cache, "r", STORED)
    assert (asked, hits) == (16, 16)
    assert kv is not None and torch.equal(kv, expected)
    cache.close()


def test_the_found_pages_are_judged_again_after_the_probe():
    # 16 stored tokens followed by 240 L3 has never seen: the probe is started (256 tokens
    # asked, the default floor) but finds 4 pages; whether they are read depends on what they
    # save.
    prompt = STORED + list(range(5000, 5240))
    cache, _ = stored_cache("gap-probe-fast", prefetch_threshold=None, host_pages=160)
    cache.controller.observe_prefill(1_000_000, 1.0)
    asked, hits, _ = serve(cache, "r", prompt)
    assert (asked, hits) == (256, 0)
    assert (cache.stats.prefetch_started, cache.stats.prefetch_skipped) == (0, 1)
    cache.close()
    cache, expected = stored_cache("gap-probe-slow", prefetch_threshold=None, host_pages=160)
    cache.controller.observe_prefill(16, 1.0)
    asked, hits, kv = serve(cache, "r", prompt)
    assert (asked, hits) == (256, 16)
    assert (cache.stats.prefetch_started, cache.stats.prefetch_skipped) == (1, 0)
    assert kv is not None and torch.equal(kv, expected)
    cache.close()


def test_load_saving():
    m = CostModel(1000, host_bytes_per_s=1e6, storage_bytes_per_s=1e6)
    assert m.load_saving("storage", 100) is None  # prefill unmeasured
    m.observe_prefill(100, 1.0)  # 10 ms/token; loading 2 ms/token (host + storage)
    assert m.load_saving("storage", 100) == pytest.approx(1.0 - 0.2)
    m.observe_prefill(10_000_000, 1.0)  # recomputing is now faster: a negative saving
    assert m.load_saving("storage", 100) < 0
    unmeasured_l3 = CostModel(1000)
    unmeasured_l3.observe_prefill(100, 1.0)
    assert unmeasured_l3.load_saving("storage", 100) == pytest.approx(1.0)  # loads count free
    assert PREFETCH_MIN_SAVING_S == 0.05
