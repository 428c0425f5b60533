"""Miss attribution: every prompt token comes to one outcome, and the sums are exact."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.attribution import OUTCOMES, EvictedSketch, complete
from tests.hicache.factories import sim_cache


def run(cache, tokens, rid="r", extra_key=None, lookup=None):
    """Prefetch, admit `lookup` (default all of `tokens`), compute, insert, release; the
    request's attribution over len(tokens) prompt tokens."""
    look = tokens if lookup is None else lookup
    cache.prefetch(rid, look, extra_key=extra_key)
    acq = cache.acquire(look, extra_key=extra_key, request_id=rid, count=False)
    cache.record_admission(acq, len(tokens))
    need = len(tokens) // cache.page_size - len(acq.device_pages)
    new = cache.alloc_device(need) if need > 0 else []
    assert new is not None
    cache.insert(tokens, list(acq.device_pages) + new, extra_key=extra_key)
    cache.release(acq.node)
    return complete(acq.outcomes, len(tokens))


def seq(base, pages, ps=4):
    return [base * 1000 + i for i in range(pages * ps)]


def evicted_then_rerun(c):
    """Run a 2-page prompt, push it out of device and host with two 4-page ones (backups
    flushed to L3 between), run it again: its attribution."""
    a = seq(1, 2)
    run(c, a)
    c.flush()
    run(c, seq(2, 4))
    run(c, seq(3, 4))
    c.flush()
    return run(c, a, "r4")


def test_never_seen_then_device_hit_and_partial_page():
    c = sim_cache(page_size=4, device_pages=16, host_pages=0)
    t = seq(1, 3) + [7, 7]  # 3 full pages and a partial one
    assert run(c, t) == {"never_seen": 12, "uncacheable": 2}
    assert run(c, t, "r2") == {"device_hit": 12, "uncacheable": 2}
    assert c.stats.prompt_outcomes["never_seen"] == 12
    assert sum(c.stats.prompt_outcomes.values()) == c.stats.input_tokens == 28


def test_evicted_device_without_host_copy():
    c = sim_cache(page_size=4, device_pages=4, host_pages=0)
    a = seq(1, 2)
    run(c, a)
    run(c, seq(2, 4))  # evicts a (no host tier: not backed up)
    assert run(c, a, "r3") == {"evicted_device": 8}


def test_evicted_host_before_l3_and_l3_evicted():
    c = sim_cache(page_size=4, device_pages=4, host_pages=4, write_policy="write_through")
    a = seq(1, 2)
    run(c, a)
    run(c, seq(2, 4))
    run(c, seq(3, 4))  # a left the device, then the host
    assert run(c, a, "r4") == {"evicted_host": 8}
    s = sim_cache(page_size=4, device_pages=4, host_pages=4, storage_pages=2,
                  write_policy="write_through", synchronous=True)
    run(s, a)
    s.flush()
    run(s, seq(2, 4))
    s.flush()
    run(s, seq(3, 4))  # a written to L3, then L3 (2 pages) dropped it
    s.flush()
    assert run(s, a, "r4") == {"l3_evicted": 8}


def test_storage_hit_and_below_prefetch_floor():
    c = sim_cache(page_size=4, device_pages=4, host_pages=4, storage_pages=None,
                  write_policy="write_through", synchronous=True, prefetch_threshold=100)
    assert evicted_then_rerun(c) == {"below_prefetch_floor": 8}


def test_other_namespace_and_uncacheable_tail():
    c = sim_cache(page_size=4, device_pages=16, host_pages=0)
    a = seq(1, 2)
    run(c, a, extra_key="tenant-a")
    assert run(c, a + [5], "r2", extra_key="tenant-b", lookup=a) == {
        "other_namespace": 8, "uncacheable": 1}


def test_admission_declined():
    c = sim_cache(page_size=4, device_pages=4, host_pages=4, storage_pages=None,
                  write_policy="write_through", synchronous=True, storage_admission="reuse:3")
    assert evicted_then_rerun(c) == {"admission_declined": 8}


def test_off_attributes_nothing():
    c = sim_cache(page_size=4, device_pages=16, host_pages=0, miss_attribution=False)
    assert c.acquire(seq(1, 2)).outcomes is None
    assert sum(c.stats.prompt_outcomes.values()) == 0


def test_sketch_is_bounded():
    s = EvictedSketch(capacity=8)
    s.add([bytes([i]) * 32 for i in range(20)], 0)
    assert len(s) == 8
    assert s.get(bytes([19]) * 32) == 0 and s.get(bytes([0]) * 32) is None


op = st.tuples(st.integers(0, 5), st.integers(0, 6), st.integers(0, 3), st.booleans())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, min_size=1, max_size=25),
    policy=st.sampled_from(["write_through", "write_back", "write_through_selective"]),
    storage=st.sampled_from([False, None, 3]),
    host=st.sampled_from([0, 4, 8]),
)
def test_sums_exact_over_random_sequences(ops, policy, storage, host):
    if storage is not False and host == 0:
        host = 4
    c = sim_cache(page_size=2, device_pages=8, host_pages=host, storage_pages=storage,
                  write_policy=policy, synchronous=True, load_back_threshold=3)
    prompt = 0
    for i, (fam, pages, tail, salted) in enumerate(ops):
        t = [fam] * 2 + [fam * 10 + j for j in range(pages * 2)] + [99] * tail
        out = run(c, t, f"r{i}", extra_key="s" if salted else None)
        assert set(out) <= set(OUTCOMES) and all(v > 0 for v in out.values())
        assert sum(out.values()) == len(t)
        prompt += len(t)
        if i % 7 == 6:
            c.evict(4)
        c.check_integrity()
    s = c.stats
    assert sum(s.prompt_outcomes.values()) == s.input_tokens == prompt
    assert s.prompt_outcomes["device_hit"] == s.device_hit_tokens
    assert s.prompt_outcomes["host_hit"] == s.host_hit_tokens
    assert s.prompt_outcomes["storage_hit"] == s.storage_hit_tokens
