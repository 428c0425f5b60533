"""One-pass analyses against the real simulated HiRadixCache: stack distances and the MRC,
Belady's OPT, the unbounded bound, and LMCache's flat LRU."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hicache.simulation import simulate_request
from tests.tools.conftest import mooncake_rows, write_jsonl
from tools.hitrate import mrc
from tools.hitrate.pages import Layout
from tools.hitrate.simulate import TierConfig, build_cache, replay
from tools.hitrate.traces import Trace, read_trace

BS = 4  # tokens per block = page size in these tests


def trace_of(tmp_path: Path, reqs: list[tuple[list[int], int]], bs: int = BS) -> Trace:
    return read_trace(write_jsonl(tmp_path / "t.jsonl", mooncake_rows(reqs, bs)), block_size=bs)


def random_reqs(
    rng: random.Random, n: int, *, aligned: bool = True, max_len: int = 6
) -> list[tuple[list[int], int]]:
    """Requests that extend or branch off earlier prompts (prefix-chained block ids)."""
    paths: list[list[int]] = []
    out = []
    next_id = 0
    for _ in range(n):
        if paths and rng.random() < 0.75:
            base = rng.choice(paths)
            path = base[: rng.randint(1, len(base))]
        else:
            path = []
        while not path or (len(path) < max_len and rng.random() < 0.5):
            path = [*path, next_id]
            next_id += 1
        paths.append(path)
        length = BS * len(path) if aligned else BS * (len(path) - 1) + rng.randint(1, BS)
        out.append((path, length))
    return out


def test_stack_distances_by_hand(tmp_path: Path) -> None:
    # pages a=0 b=1 c=2: r0 [a b], r1 [a c], r2 [a b], r3 [a c b'] (b' new)
    tr = trace_of(tmp_path, [([0, 1], 0), ([0, 2], 0), ([0, 1], 0), ([0, 2, 3], 0)])
    res = mrc.stack_distances(Layout(tr, BS).all_paged(), BS, keep_distances=True)
    # After r0 the stack is a, b; after r1: a, c, b; after r2: a, b, c.
    assert res.distances == [[], [1], [1, 3], [1, 3]]
    assert res.hit_tokens_at == {1: 3 * BS, 3: 2 * BS}
    assert res.hit_requests_at == {1: 3}
    assert res.cold_pages == 2 + 1 + 0 + 1
    assert res.hit_tokens(2) == 3 * BS and res.hit_tokens(3) == 5 * BS
    assert res.capacity_for(5 * BS / res.input_tokens) == 3
    assert res.capacity_for(0.99) is None
    assert mrc.unbounded(Layout(tr, BS).all_paged(), BS) == (5 * BS, 3)


def test_partial_last_block_is_capped(tmp_path: Path) -> None:
    # The second request repeats the first; its last block holds 1 token of 4.
    tr = trace_of(tmp_path, [([0, 1], 5), ([0, 1], 5)])
    paged = Layout(tr, BS).all_paged()
    assert mrc.unbounded(paged, BS) == (5, 1)
    res = replay(tr, TierConfig(page_size=BS, device_pages=8))
    assert (res.device_hit_tokens, res.capped_tokens) == (5, 3)


def _replay_with_occupancy(tr: Trace, capacity: int) -> tuple[list[int], list[int]]:
    """(hit pages, device pages in use before it) per request, LRU device only."""
    cache = build_cache(TierConfig(page_size=BS, device_pages=capacity), capacity)
    lay = Layout(tr, BS)
    hits, occ = [], []
    for i, req in enumerate(tr.requests):
        occ.append(capacity - cache.usage()["device_pages_free"])
        prompt, out = lay.prompt_output(req)
        hits.append(simulate_request(cache, str(i), prompt, out).device_hit_tokens // BS)
        cache.check_integrity()
    return hits, occ


@pytest.mark.parametrize("seed", range(6))
def test_mrc_vs_hiradix_lru(tmp_path: Path, seed: int) -> None:
    """The exact relation between the one-pass curve and separate runs of the tree's LRU.

    The tree evicts whole leaf nodes, so it may hold fewer than C pages; but what it holds is
    always the top of the LRU stack. Hence, per request, its hit pages are #{i: d_i <= m} with m
    the pages it held at that moment; and hits(C) <= MRC(C), equal once nothing is evicted.
    """
    rng = random.Random(seed)
    tr = trace_of(tmp_path, random_reqs(rng, 120))
    paged = Layout(tr, BS).all_paged()
    res = mrc.stack_distances(paged, BS, keep_distances=True)
    assert res.distances is not None
    for ds in res.distances:  # distances grow strictly along a path (prefix-closed top-C sets)
        assert all(a < b for a, b in zip(ds, ds[1:]))
    biggest = max(len(p.pages) for p in paged)
    for cap in sorted({biggest, biggest + 3, 2 * biggest, 40, res.max_pages}):
        if cap < biggest:
            continue
        hits, occ = _replay_with_occupancy(tr, cap)
        for ds, h, m in zip(res.distances, hits, occ):
            assert h == sum(1 for d in ds if d <= m)
        real = replay(tr, TierConfig(page_size=BS, device_pages=cap))
        assert real.hit_tokens == sum(h * BS for h in hits)
        assert real.hit_tokens <= res.hit_tokens(cap)
    full = replay(tr, TierConfig(page_size=BS, device_pages=res.max_pages))
    assert full.hit_tokens == res.hit_tokens(res.max_pages) == res.unbounded_hit_tokens


@pytest.mark.parametrize("seed", range(4))
def test_mrc_equals_separate_lru_runs_for_single_page_nodes(tmp_path: Path, seed: int) -> None:
    """With one page per request (every node a single page) whole-node eviction is page
    eviction, and the one-pass curve equals a separate HiRadixCache run at every capacity."""
    rng = random.Random(seed)
    reqs = [([rng.randrange(30)], 0) for _ in range(300)]
    tr = trace_of(tmp_path, reqs)
    res = mrc.stack_distances(Layout(tr, BS).all_paged(), BS)
    for cap in range(1, 32):
        real = replay(tr, TierConfig(page_size=BS, device_pages=cap))
        assert real.hit_tokens == res.hit_tokens(cap), cap
        assert real.hit_requests == res.hit_requests(cap), cap


POLICIES = ["lru", "lfu", "slru", "fifo", "mru", "priority"]


@pytest.mark.parametrize("seed", range(5))
def test_opt_beats_every_policy(tmp_path: Path, seed: int) -> None:
    rng = random.Random(100 + seed)
    tr = trace_of(tmp_path, random_reqs(rng, 100))
    paged = Layout(tr, BS).all_paged()
    biggest = max(len(p.pages) for p in paged)
    ub, _ = mrc.unbounded(paged, BS)
    tier_sets = [
        (biggest, 0, 0),
        (biggest + 4, 0, 0),
        (biggest, 2 * biggest, 0),
        (2 * biggest, 8, 0),
        (biggest, biggest, 6),  # with a storage tier (OPT gets the sum of the three)
    ]
    for dev, host, sto in tier_sets:
        opt = mrc.belady(paged, BS, dev + host + sto)
        assert opt.hit_tokens <= ub
        for policy in POLICIES:
            for write in ["write_through", "write_back"] if host else ["write_through"]:
                tiers = TierConfig(
                    page_size=BS,
                    device_pages=dev,
                    host_pages=host,
                    storage_pages=sto,
                    eviction_policy=policy,
                    write_policy=write,
                    load_back_threshold=0,
                    prefetch_threshold=0,
                )
                real = replay(tr, tiers)
                assert real.hit_tokens <= opt.hit_tokens, (policy, write, dev, host, sto)


@pytest.mark.parametrize("seed", range(3))
def test_opt_is_optimal_on_tiny_traces(seed: int) -> None:
    """Exhaustive search over every eviction choice agrees with Belady on tiny traces."""
    from itertools import combinations

    rng = random.Random(7 + seed)
    reqs_raw = random_reqs(rng, 9, max_len=3)
    paged = [mrc.PagedRequest(list(p), len(p), BS * len(p)) for p, _ in reqs_raw]

    def best(i: int, cached: frozenset[int], cap: int, memo: dict) -> int:
        if i == len(paged):
            return 0
        key = (i, cached)
        if key in memo:
            return memo[key]
        r = paged[i]
        k = 0
        while k < r.n_lookup and r.pages[k] in cached:
            k += 1
        gain = BS * k
        full = cached | set(r.pages)
        out = 0
        for keep in combinations(sorted(full), min(cap, len(full))):
            ks = frozenset(keep)
            # only prefix-closed sets are useful states; others cannot hit more
            out = max(out, best(i + 1, ks, cap, memo))
        memo[key] = gain + out
        return gain + out

    for cap in (1, 2, 3, 4):
        assert mrc.belady(paged, BS, cap).hit_tokens == best(0, frozenset(), cap, {}), cap


def test_flat_order_matches_lmcache_simulator(tmp_path: Path) -> None:
    sim = pytest.importorskip(
        "lmcache.tools.cache_simulator.simulator", reason="lmcache is not installed"
    )
    rng = random.Random(3)
    reqs = random_reqs(rng, 200)
    events = [
        {"chunk_hashes": [f"0x{b:x}" for b in path], "seq_len": n, "chunk_size": BS}
        for path, n in reqs
    ]
    rows = [{"timestamp": i, "chunk_size": BS, **e} for i, e in enumerate(events)]
    tr = read_trace(write_jsonl(tmp_path / "lm.jsonl", rows))
    res = mrc.stack_distances(Layout(tr, BS).all_paged(), BS, order="flat")
    for cap in (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 400):
        lm = sim.simulate(events, cap * 100, 100, fast=True)
        assert res.hit_tokens(cap) == lm["total_hit_tokens"], cap


def test_reference_unbounded_hit_ratio(mooncake_trace: Path) -> None:
    tr = read_trace(mooncake_trace)
    paged = Layout(tr, 512).all_paged()
    hit, _ = mrc.unbounded(paged, 512)
    n_in = sum(r.input_len for r in tr.requests)
    assert round(hit / n_in, 3) == 0.374
    res = mrc.stack_distances(paged, 512)
    assert res.unbounded_hit_tokens == hit
    assert mrc.belady(paged, 512, res.max_pages).hit_tokens == hit
