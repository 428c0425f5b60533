"""Randomised operation sequences with check_integrity() after every step."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.eviction import EVICTION_POLICIES
from tests.hicache.factories import sim_cache, tensor_cache

WRITE_POLICIES = ["write_through", "write_through_selective", "write_back"]

op = st.one_of(
    st.tuples(st.just("start"), st.integers(0, 7), st.integers(1, 5)),  # request: family, pages
    st.tuples(st.just("finish"), st.integers(0, 10), st.just(0)),
    st.tuples(st.just("evict"), st.integers(1, 6), st.just(0)),
    st.tuples(st.just("evict_host"), st.integers(1, 6), st.just(0)),
    st.tuples(st.just("flush"), st.just(0), st.just(0)),
)


def family_tokens(fam: int, pages: int, ps: int) -> list[int]:
    # Families share prefixes: family f = [f//4, f//2, f, ...] page by page.
    out: list[int] = []
    for p in range(pages):
        tok = (fam >> max(0, 2 - p)) if p < 3 else fam * 7 + p
        out.extend([tok] * ps)
    return out


def start_request(cache, rid: int, fam: int, pages: int, ps: int, *, wait: bool = True):
    """Prefetch, admit and allocate request `rid` of family `fam` with `pages` pages: its
    (tokens, pages, locked node, pages newly allocated), or None (and nothing held) when the
    device pool has no room. `wait` waits until the prefetch policy lets it be scheduled."""
    tokens = family_tokens(fam, pages, ps)
    cache.prefetch(str(rid), tokens)
    while wait and not cache.prefetch_ready(str(rid)):  # wait_complete / timeout policies
        time.sleep(0.001)
    acq = cache.acquire(tokens, request_id=str(rid))
    need = pages - len(acq.device_pages)
    new = cache.alloc_device(need) if need > 0 else []
    if new is None:
        cache.release(acq.node)
        return None
    return tokens, list(acq.device_pages) + new, acq.node, len(new)


def run_ops(cache, ops, ps):
    running: list[tuple] = []
    outside = 0
    rid = 0
    for kind, a, b in ops:
        if kind == "start":
            rid += 1
            req = start_request(cache, rid, a, b, ps)
            if req is not None:
                running.append(req)
                outside += req[3]
        elif kind == "finish" and running:
            tokens, pages, node, n_new = running.pop(a % len(running))
            res = cache.insert(tokens, pages)
            assert len(res.device_pages) == len(pages)
            # Every page the request allocated is now the tree's or was freed as a duplicate.
            assert set(pages) <= set(res.device_pages) | set(res.duplicate_pages)
            cache.release(node)
            outside -= n_new
        elif kind == "evict":
            cache.evict(a * ps)
        elif kind == "evict_host":
            cache.evict_host(a * ps)
        elif kind == "flush":
            cache.flush()
        cache.poll()
        cache.check_integrity(outside)
    for tokens, pages, node, _ in running:
        cache.insert(tokens, pages)
        cache.release(node)
    cache.flush()
    cache.check_integrity(0)
    for n in cache.tree.nodes():
        assert n.lock_ref == 0 and n.host_ref == 0


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=40))
def test_simulated_sequences(page_size, write_policy, policy, ops):
    cache = sim_cache(page_size=page_size, device_pages=12, host_pages=10, storage_pages=20,
                      write_policy=write_policy, eviction_policy=policy)
    run_ops(cache, ops, page_size)


@pytest.mark.parametrize("prefetch_policy", ["best_effort", "wait_complete", "timeout"])
@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=30))
def test_threaded_tensor_sequences(write_policy, prefetch_policy, ops):
    """Real tensors, background threads, memory L3: the same invariants hold at every step."""
    cache = tensor_cache(page_size=4, device_pages=12, host_pages=10, write_policy=write_policy,
                         prefetch_policy=prefetch_policy, prefetch_timeout_base=0.05,
                         prefetch_timeout_per_ki_token=0.0)
    try:
        run_ops(cache, ops, 4)
    finally:
        cache.close()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=40))
def test_simulated_buffer_only_sequences(page_size, write_policy, ops):
    cache = sim_cache(page_size=page_size, device_pages=12, host_pages=10, storage_pages=20,
                      write_policy=write_policy, host_memory_mode="buffer_only")
    run_ops(cache, ops, page_size)
    # Nothing is cached in host memory once every transfer is done.
    assert [n for n in cache.tree.nodes() if n.host_value is not None] == []


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=30))
def test_threaded_buffer_only_sequences(write_policy, ops):
    cache = tensor_cache(page_size=4, device_pages=12, host_pages=10, write_policy=write_policy,
                         host_memory_mode="buffer_only", prefetch_policy="wait_complete")
    try:
        run_ops(cache, ops, 4)
        assert [n for n in cache.tree.nodes() if n.host_value is not None] == []
    finally:
        cache.close()
