"""The load-vs-recompute cost model (`hicache.costmodel`) and the measurements feeding it.

A throttled wrapper around a real backend (reads sleep for bytes / rate) makes L3 slower than
recomputing: the measured storage bandwidth then flips the plan to recompute."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
import torch

from hicache.costmodel import CostModel, Ewma, LoadPlan
from hicache.memory_backend import MemoryBackend
from hicache_client.backend import StorageBackend, StorageConfig
from tests.hicache.factories import tensor_cache


class ThrottledBackend(StorageBackend):
    """A real backend slowed down: every read takes at least `bytes / read_bytes_per_s`."""

    name = "throttled"

    def __init__(self, inner: StorageBackend, read_bytes_per_s: float) -> None:
        super().__init__(inner.config)
        self.inner = inner
        self.rate = read_bytes_per_s

    def batch_exists(self, keys: Sequence[str]) -> int:
        return self.inner.batch_exists(keys)

    def _get_into(self, keys: Sequence[str], out: Sequence[memoryview]) -> list[int]:
        lengths = self.inner._get_into(keys, out)
        time.sleep(sum(max(n, 0) for n in lengths) / self.rate)
        return lengths

    def batch_set(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]:
        return self.inner.batch_set(keys, values)

    def delete(self, keys: Sequence[str]) -> None:
        self.inner.delete(keys)

    def clear(self) -> None:
        self.inner.clear()


# -- the pure model ---------------------------------------------------------------------------


def test_ewma():
    e = Ewma(0.5)
    assert e.value is None
    assert e.update(10) == 10
    assert e.update(20) == 15
    assert Ewma(0.5, prior=4).update(8) == 8  # the first measurement replaces the prior
    with pytest.raises(ValueError):
        Ewma(0)


def model(**kw) -> CostModel:
    # 1 KB per token; host 1 MB/s -> 1 ms/token; storage 100 KB/s -> +10 ms/token.
    args = {"prefill_tokens_per_s": 200.0, "host_bytes_per_s": 1e6, "storage_bytes_per_s": 1e5}
    args.update(kw)
    return CostModel(1000, **args)


def test_plan_loads_what_is_cheaper_than_recomputing():
    # recompute 5 ms/token; host 1 ms/token (load); storage 11 ms/token (recompute).
    assert model().plan(64, 128) == LoadPlan(64, 0, 128, pytest.approx(0.064),
                                             pytest.approx(0.64))
    # Faster storage (1 MB/s: 2 ms/token in all): load everything.
    p = model(storage_bytes_per_s=1e6).plan(64, 128)
    assert (p.host_tokens, p.storage_tokens, p.recompute_tokens) == (64, 128, 0)
    assert p.load_s == pytest.approx(0.064 + 0.256)
    # Slow host: neither tier is worth it (storage goes through host).
    p = model(host_bytes_per_s=1e5, storage_bytes_per_s=1e9).plan(64, 128)
    assert (p.host_tokens, p.storage_tokens, p.recompute_tokens) == (0, 0, 192)


def test_plan_rounds_to_pages_and_counts_latency():
    p = model(storage_bytes_per_s=1e6).plan(70, 100, page_size=32)
    assert (p.host_tokens, p.storage_tokens) == (64, 96)
    # A fixed 1 s latency on L3 outweighs 96 tokens (0.48 s to recompute) ...
    m = model(storage_bytes_per_s=1e6, storage_latency_s=1.0)
    assert m.plan(64, 96).storage_tokens == 0
    # ... but not 960 (4.8 s to recompute vs 1 + 1.92 s to load).
    assert m.plan(64, 960).storage_tokens == 960


def test_unmeasured_model_loads_everything():
    m = CostModel(1000)
    assert m.plan(64, 128) == LoadPlan(64, 128, 0, 0.0, 0.0)
    m.observe_prefill(1000, 1.0)  # only prefill known: still load
    assert m.plan(64, 128).storage_tokens == 128


def test_observations_move_the_decision():
    m = model(storage_bytes_per_s=1e6)
    assert m.plan(0, 100).storage_tokens == 100
    for _ in range(10):
        m.observe_load("storage", 10_000, 1.0)  # 10 KB/s measured
    assert m.bandwidth["storage"].value == pytest.approx(10_000, rel=0.05)
    assert m.plan(0, 100).storage_tokens == 0
    with pytest.raises(ValueError):
        m.observe_load("gpu", 1, 1.0)


# -- measured through the controller ----------------------------------------------------------


def l3_cache(read_rate: float | None, name: str):
    inner = MemoryBackend(StorageConfig(extra={"shared": name}))
    backend = inner if read_rate is None else ThrottledBackend(inner, read_rate)
    return tensor_cache(storage=backend, synchronous=True)


def measure_storage(cache) -> None:
    tokens = list(range(64))  # 16 pages of 4
    pages = cache.alloc_device(16)
    pool = cache.device_pool
    pool.kv[:, :, pool.slots(pages)] = torch.randn(pool.kv[:, :, pool.slots(pages)].shape)
    cache.insert(tokens, pages)
    cache.flush()
    cache.evict(1000)
    cache.evict_host(1000)
    assert cache.prefetch("r", tokens) == 64
    cache.flush()
    acq = cache.acquire(tokens, request_id="r")
    assert acq.storage_hit_tokens == 64
    cache.release(acq.node)


def test_slow_backend_flips_the_plan_to_recompute():
    cache = l3_cache(read_rate=20_000.0, name="cost-slow")  # 20 KB/s
    measure_storage(cache)
    cost = cache.controller.cost
    assert cost is not None
    # Reads slept >= bytes / 20 KB/s, so the measured bandwidth is at most that.
    assert 0 < cost.bandwidth["storage"].value <= 20_000.0
    assert cost.bandwidth["host"].value is not None  # the load-back was timed too
    cache.controller.observe_prefill(10_000, 1.0)  # a model that computes 10k tokens/s
    plan = cache.controller.plan_load(0, 640, page_size=4)
    assert (plan.storage_tokens, plan.recompute_tokens) == (0, 640)
    cache.close()


def test_fast_backend_keeps_loading():
    cache = l3_cache(read_rate=None, name="cost-fast")
    measure_storage(cache)
    cache.controller.observe_prefill(1, 1.0)  # a model that computes 1 token/s
    plan = cache.controller.plan_load(64, 640, page_size=4)
    assert (plan.host_tokens, plan.storage_tokens, plan.recompute_tokens) == (64, 640, 0)
    cache.close()


def test_a_load_is_kept_unless_recomputing_saves_min_saving_s():
    # Storage costs 11 ms/token against 5 ms/token to recompute: 16 tokens would save 96 ms,
    # under the default 0.1 s, so they are loaded; 32 tokens save 192 ms and are recomputed.
    assert model().plan(0, 16).storage_tokens == 16
    assert model().plan(0, 32).storage_tokens == 0
    assert model(min_saving_s=0.0).plan(0, 16).storage_tokens == 0


def test_a_tier_judged_slow_is_measured_again_after_remeasure_s():
    """Recomputing never measures the tier it avoided: once `remeasure_s` has passed without a
    measurement, one plan loads it (one per period), and what that load measures decides."""
    now = [0.0]
    m = model(storage_bytes_per_s=1e6, remeasure_s=30.0, clock=lambda: now[0])
    for _ in range(10):
        m.observe_load("storage", 10_000, 1.0)  # 10 KB/s: far slower than recomputing
    assert m.plan(0, 100).storage_tokens == 0
    now[0] = 29.9
    assert m.plan(0, 100).storage_tokens == 0
    now[0] = 30.0
    assert m.plan(0, 100).storage_tokens == 100  # let through, to be measured
    assert m.plan(0, 100).storage_tokens == 0  # only one per period
    assert m.remeasures == 1
    for _ in range(10):
        m.observe_load("storage", 10_000_000, 1.0)  # the backend recovered: 10 MB/s
    assert m.plan(0, 100).storage_tokens == 100
    assert m.remeasures == 1
    # Never, when switched off.
    off = model(storage_bytes_per_s=1e4, remeasure_s=None, clock=lambda: now[0])
    now[0] = 1e6
    assert off.plan(0, 100).storage_tokens == 0 and off.remeasures == 0
