"""Exact eviction order per policy (simulated cache, page size 2, one page per sequence)."""

from __future__ import annotations

from hicache.hiradix import HiRadixCache
from tests.hicache.factories import run_request, sim_cache

A, B, C = [1, 1], [2, 2], [3, 3]
SEQS = {"A": A, "B": B, "C": C}


def on_device(cache: HiRadixCache) -> set[str]:
    # Read the tree directly: match_prefix would refresh access times and change the order.
    names = {tuple(s): n for n, s in SEQS.items()}
    return {names[n.key] for n in cache.tree.nodes() if n.value is not None}


def eviction_order(cache: HiRadixCache) -> list[str]:
    order = []
    while True:
        before = on_device(cache)
        if not before:
            return order
        assert cache.evict(2) == 2
        (gone,) = before - on_device(cache)
        order.append(gone)
        cache.check_integrity(0)


def hit(cache: HiRadixCache, seq: list[int], times: int = 1) -> None:
    for _ in range(times):
        acq = cache.acquire(seq + [0])  # one extra token: the whole page is a cached prefix
        assert acq.cached_tokens == 2
        cache.release(acq.node)


def fresh(policy: str, **cfg) -> HiRadixCache:
    cache = sim_cache(page_size=2, device_pages=8, host_pages=0, eviction_policy=policy, **cfg)
    return cache


def insert_all(cache: HiRadixCache, priorities=(0, 0, 0)) -> None:
    for seq, prio in zip((A, B, C), priorities):
        pages = cache.alloc_device(1)
        cache.insert(seq, pages, priority=prio)


def test_lru():
    c = fresh("lru")
    insert_all(c)
    hit(c, A)
    assert eviction_order(c) == ["B", "C", "A"]


def test_mru():
    c = fresh("mru")
    insert_all(c)
    hit(c, A)
    assert eviction_order(c) == ["A", "C", "B"]


def test_fifo_ignores_access():
    c = fresh("fifo")
    insert_all(c)
    hit(c, A, 3)
    assert eviction_order(c) == ["A", "B", "C"]


def test_lfu_with_lru_ties():
    c = fresh("lfu")
    insert_all(c)
    hit(c, A, 3)
    hit(c, C, 2)
    hit(c, B, 2)  # B and C tie on count: C was used less recently, so C goes first
    assert eviction_order(c) == ["C", "B", "A"]


def test_priority():
    c = fresh("priority")
    insert_all(c, priorities=(5, 1, 3))
    assert eviction_order(c) == ["B", "C", "A"]


def test_slru_protects_at_threshold():
    # The insert that creates a node is its first use (as in SGLang): one hit makes two.
    c = fresh("slru", eviction_config={"protected_threshold": 2})
    insert_all(c)
    hit(c, A, 1)  # A reaches the threshold: protected
    assert [n.hit_count for n in sorted(c.tree.nodes(), key=lambda n: n.key)] == [2, 1, 1]
    c.match_prefix(B + [0])  # B probationary, more recent than A (a match is no hit)
    assert eviction_order(c) == ["C", "B", "A"]


def test_slru_below_threshold_is_lru():
    c = fresh("slru", eviction_config={"protected_threshold": 3})
    insert_all(c)
    hit(c, A, 1)
    hit(c, B, 1)
    assert eviction_order(c) == ["C", "A", "B"]


def test_locked_nodes_are_not_evicted():
    c = fresh("lru")
    insert_all(c)
    acq = c.acquire(A + [0])
    assert c.evict(100) == 4
    assert on_device(c) == {"A"}
    c.release(acq.node)
    assert c.evict(100) == 2
    c.check_integrity(0)


def test_only_leaves_evicted_parent_after_child():
    c = sim_cache(page_size=2, device_pages=8, host_pages=0)
    run_request(c, [1, 1, 2, 2])
    run_request(c, [1, 1, 3, 3])
    # Leaves [2,2] and [3,3] go before their shared parent [1,1].
    parent = c.tree.match((1, 1)).nodes[0]
    assert c.evict(2) == 2
    assert parent.value is not None
    assert c.evict(2) == 2
    assert parent.value is not None
    assert c.evict(2) == 2
    assert parent.removed
    c.check_integrity(0)
