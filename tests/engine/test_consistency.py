"""Greedy outputs are identical with caching off, a device-only radix cache and HiCache with every
write policy x prefetch policy x {memory, file} storage, under device-pool pressure."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.engine import Engine
from hicache.config import PREFETCH_POLICIES, WRITE_POLICIES
from tests.engine.workload import make_sessions, run_sessions

pytestmark = pytest.mark.slow

# 768 device tokens for ~50 sessions of ~100-180 tokens: the working set is many times the device
# pool and about 5x the host pool (2x device), so pages go device -> host -> storage and back.
BASE: dict[str, Any] = {
    "page_size": 4,
    "max_total_tokens": 768,
    "max_running_requests": 4,
    "chunked_prefill_size": 64,
}
N_SESSIONS = 50


@pytest.fixture(scope="module")
def sessions() -> Any:
    return make_sessions(N_SESSIONS, seed=7, turns=(3, 5), user_len=(8, 24))


@pytest.fixture(scope="module")
def reference(tiny_model: Path, sessions: Any) -> list[list[int]]:
    with Engine(model_path=str(tiny_model), disable_radix_cache=True, **BASE) as e:
        out = run_sessions(e, sessions)
        stats = e.cache_stats()
    assert stats["hit_tokens"] == 0
    assert len(out) >= 3 * N_SESSIONS
    return out


def _check_idle(engine: Engine) -> None:
    """Idle engine: every device page is in the tree or free; the cache's invariants hold."""
    engine.wait_transfers(timeout=60)
    engine.cache.check_integrity(outside_device_pages=0)
    usage = engine.cache.usage()
    ps = usage["page_size"]
    assert usage["device_pages_free"] + usage["device_cached_tokens"] // ps == (
        usage["device_pages_total"]
    )


def test_device_radix_cache(tiny_model: Path, sessions: Any, reference: list[list[int]]) -> None:
    with Engine(model_path=str(tiny_model), **BASE) as e:
        out = run_sessions(e, sessions)
        st = e.cache_stats()
        _check_idle(e)
    assert out == reference
    assert st["device_hit_tokens"] > 0
    assert st["evicted_tokens"] > 0  # pressure: the device pool had to evict
    assert st["host_hit_tokens"] == st["storage_hit_tokens"] == 0


@pytest.fixture(scope="module")
def storage_hits() -> Iterator[dict[str, int]]:
    hits: dict[str, int] = {}
    yield hits
    # Across its six runs, every write policy that backs pages up to L3 got L3 hits. A single
    # run can be unlucky: transfers are asynchronous, so with best_effort / timeout a page may
    # still be on its way to L3 (its host copy pinned meanwhile) when the request comes back;
    # write_back pages reach L3 only when host memory evicts them.
    for wp in ("write_through", "write_back"):
        if any(k.startswith(wp + "/") for k in hits):
            assert sum(v for k, v in hits.items() if k.startswith(wp + "/")) > 0, hits


@pytest.mark.parametrize(
    ("write_policy", "prefetch_policy", "backend"),
    list(itertools.product(WRITE_POLICIES, PREFETCH_POLICIES, ("memory", "file"))),
)
def test_hierarchical_cache(
    tiny_model: Path,
    sessions: Any,
    reference: list[list[int]],
    storage_hits: dict[str, int],
    tmp_path: Path,
    write_policy: str,
    prefetch_policy: str,
    backend: str,
) -> None:
    # load_margin: always load (these tests check the tiers, not the load-vs-recompute plan).
    extra: dict[str, Any] = {"prefetch_threshold": 8, "prefetch_timeout_base": 0.5,
                             "load_margin": 1e9}
    if backend == "file":
        extra["path"] = str(tmp_path / "pages")
    with Engine(
        model_path=str(tiny_model),
        enable_hierarchical_cache=True,
        hicache_ratio=2.0,
        hicache_write_policy=write_policy,
        hicache_storage_prefetch_policy=prefetch_policy,
        hicache_storage_backend=backend,
        hicache_storage_backend_extra_config=extra,
        **BASE,
    ) as e:
        out = run_sessions(e, sessions)
        _check_idle(e)
        st = e.cache_stats()
    assert out == reference
    assert st["device_hit_tokens"] > 0
    assert st["evicted_tokens"] > 0
    assert st["host_hit_tokens"] > 0
    assert st["storage"] is not None
    if write_policy != "write_through_selective":
        # Host memory overflowed and pages were written to L3.
        assert st["evicted_host_tokens"] > 0
        assert st["storage_backup_pages"] > 0
        assert st["storage"]["set_pages"] > 0
    if write_policy == "write_through" and prefetch_policy == "wait_complete":
        assert st["storage_hit_tokens"] > 0
    storage_hits[f"{write_policy}/{prefetch_policy}/{backend}"] = int(st["storage_hit_tokens"])


def _run_on_file_l3(
    tiny_model: Path, sessions: Any, tmp_path: Path, **kw: Any
) -> tuple[list[list[int]], dict[str, Any]]:
    """Run the sessions on an engine with host and `file` L3 tiers (prefetches waited for),
    check it ends idle; its outputs and cache stats."""
    with Engine(
        model_path=str(tiny_model),
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_prefetch_policy="wait_complete",
        hicache_storage_backend_extra_config={"path": str(tmp_path / "p"),
                                              "prefetch_threshold": 8, "load_margin": 1e9},
        **kw,
        **BASE,
    ) as e:
        out = run_sessions(e, sessions)
        _check_idle(e)
        return out, e.cache_stats()


@pytest.mark.parametrize(
    ("layout", "io_backend"),
    [("page_first", "direct"), ("page_first_direct", "kernel"), ("layer_first", "kernel")],
)
def test_host_layouts(
    tiny_model: Path,
    sessions: Any,
    reference: list[list[int]],
    tmp_path: Path,
    layout: str,
    io_backend: str,
) -> None:
    out, st = _run_on_file_l3(tiny_model, sessions, tmp_path, hicache_mem_layout=layout,
                              hicache_io_backend=io_backend)
    assert out == reference
    assert st["host_hit_tokens"] > 0 and st["storage_hit_tokens"] > 0


def test_host_memory_as_a_buffer_only(
    tiny_model: Path, sessions: Any, reference: list[list[int]], tmp_path: Path
) -> None:
    """buffer_only: host memory stages pages to and from L3 and caches none; outputs equal."""
    out, st = _run_on_file_l3(tiny_model, sessions, tmp_path,
                              hicache_host_memory_mode="buffer_only", hicache_synchronous=True)
    assert out == reference
    assert st["host_hit_tokens"] == 0 and st["storage_hit_tokens"] > 0
    assert st["usage"]["host_cached_tokens"] == 0
    assert st["usage"]["host_pages_free"] == st["usage"]["host_pages_total"]
