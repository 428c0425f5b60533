"""The cost model is calibrated at start-up (issue 30 item 5): a short forward, a host -> device
copy and, with an L3 backend, a short L3 read, recorded in the cache stats before the first
request; the probe leaves no trace in the pools, the store or the serving backend's counters.
(tests/engine/test_cost_wiring.py: with a slow L3 the first request recomputes.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.engine import Engine
from hicache.calibration import MIN_PROBE_PAGES, probe_keys
from hicache_client.codec import HEADER_BYTES

PAGE = 4
POOL_TOKENS = 1024


def _engine(model: Path, **kw: Any) -> Engine:
    return Engine(model_path=str(model), page_size=PAGE, max_total_tokens=POOL_TOKENS, **kw)


def test_calibrated_before_the_first_request(tiny_model: Path, tmp_path: Path) -> None:
    store = tmp_path / "pages"
    with _engine(tiny_model, enable_hierarchical_cache=True, hicache_storage_backend="file",
                 hicache_storage_backend_extra_config={"path": str(store)}) as eng:
        st = eng.cache_stats()
        cost = st["cost_model"]
        cal = cost["calibration"]
        bpt = cost["bytes_per_token"]
        assert bpt == eng.runner.pool.bytes_per_token
        # The forward: min(chunked_prefill_size, 256 on CPU, context - 1, half the pool) tokens.
        assert cal["prefill_tokens"] == 256 and cal["prefill_seconds"] > 0
        assert cost["prefill_tokens_per_s"] == cal["prefill_tokens_per_s"] == 256 / cal[
            "prefill_seconds"]
        # The probe: 8 MiB on CPU, capped at half the free device pages (128 of 256).
        pages = POOL_TOKENS // PAGE // 2
        assert pages >= MIN_PROBE_PAGES
        assert cal["host_bytes"] == pages * PAGE * bpt
        assert cost["host_bytes_per_s"] == cal["host_bytes_per_s"] > 0
        record = HEADER_BYTES + PAGE * bpt
        assert cal["storage_bytes"] == pages * record
        assert cost["storage_bytes_per_s"] == cal["storage_bytes_per_s"] > 0
        assert cost["storage_samples"] == 1 and "error" not in cal
        # No trace: every page free, nothing cached, the store empty, the serving backend idle.
        usage = st["usage"]
        assert usage["device_pages_free"] == usage["device_pages_total"]
        assert usage["host_pages_free"] == usage["host_pages_total"]
        assert st["hit_tokens"] == 0 and st["requests"] == 0
        assert [p for p in store.rglob("*") if p.is_file()] == []
        assert all(v == 0 for v in st["storage"].values()), st["storage"]


def test_host_tier_only_and_no_tier(tiny_model: Path) -> None:
    with _engine(tiny_model, enable_hierarchical_cache=True) as eng:
        cal = eng.cache_stats()["cost_model"]["calibration"]
        assert sorted(cal) == ["host_bytes", "host_bytes_per_s", "host_seconds",
                               "prefill_seconds", "prefill_tokens", "prefill_tokens_per_s"]
    with _engine(tiny_model) as eng:  # device cache only: nothing to load, nothing measured
        cost = eng.cache_stats()["cost_model"]
        assert cost["calibration"] == {} and cost["prefill_tokens_per_s"] is None
    with _engine(tiny_model, disable_radix_cache=True) as eng:
        assert eng.cache_stats()["cost_model"] is None


def test_a_backend_that_cannot_be_probed_leaves_l3_unmeasured(tiny_model: Path) -> None:
    from hicache.memory_backend import MemoryBackend
    from hicache_client.registry import register_backend

    class ReadOnly(MemoryBackend):
        def batch_set(self, keys: Any, values: Any) -> list[bool]:
            return [False] * len(keys)

    register_backend("read-only-memory", lambda cfg: ReadOnly(cfg))
    with _engine(tiny_model, enable_hierarchical_cache=True,
                 hicache_storage_backend="read-only-memory") as eng:
        cost = eng.cache_stats()["cost_model"]
        pages = POOL_TOKENS // PAGE // 2
        assert cost["calibration"]["storage_error"] == f"0 of {pages} probe pages written"
        assert cost["storage_bytes_per_s"] is None and cost["host_bytes_per_s"] > 0


def test_probe_keys_are_per_namespace_and_rank() -> None:
    a = probe_keys(b"\1" * 32, 0, 3)
    assert len(set(a)) == 3 and all(len(k) == 64 for k in a)
    assert a == probe_keys(b"\1" * 32, 0, 3)
    assert not set(a) & set(probe_keys(b"\1" * 32, 1, 3))
    assert not set(a) & set(probe_keys(b"\2" * 32, 0, 3))


@pytest.mark.parametrize("tokens", [8, 64])
def test_measure_prefill_gives_its_pages_back(tiny_model: Path, tokens: int) -> None:
    with _engine(tiny_model) as eng:
        alloc = eng.runner.pool.allocator
        before = alloc.num_free
        assert eng.runner.measure_prefill(tokens) > 0
        assert alloc.num_free == before
