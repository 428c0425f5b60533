"""The compiled analyses (`tools/hitrate/fast.py`) over streamed arrays (`arrays.py`), checked
against the readable one-pass reference (`mrc.py`) and against the exact replay through the real
simulated `HiRadixCache`, on traces with shared prefixes, partial blocks, output insertion and
evictions in every tier."""

from __future__ import annotations

import json
import random
from array import array
from pathlib import Path

import numpy as np
import pytest

from tests.tools.test_mrc import BS, random_reqs, trace_of
from tests.tools.test_replay_modes import TIERS, block_trace, engine_trace
from tools.hitrate import fast, fast_replay, mrc
from tools.hitrate.arrays import BlockSink, PageArrays, extend_ids, from_trace
from tools.hitrate.pages import Layout
from tools.hitrate.simulate import TierConfig, replay, replay_arrays
from tools.hitrate.traces import Trace, read_trace


def streamed(path: Path, page_size: int, **kw: object) -> tuple[Trace, PageArrays]:
    sink = BlockSink()
    tr = read_trace(path, sink=sink, **kw)  # type: ignore[arg-type]
    assert tr.requests == [] and tr.count == len(sink)
    return tr, sink.arrays(tr, page_size)


def lmcache_trace(tmp_path: Path, seed: int, n: int = 150) -> Path:
    """An LMCache lookup log whose timestamps are out of order (replayed sorted, stably)."""
    rng = random.Random(seed)
    p = tmp_path / f"lm{seed}.jsonl"
    with open(p, "w") as f:
        for i, (path, n_in) in enumerate(random_reqs(rng, n)):
            f.write(json.dumps({"timestamp": rng.randrange(20), "request_id": f"r{i}",
                                "chunk_size": BS, "seq_len": n_in + rng.randrange(BS),
                                "chunk_hashes": [f"0x{b:x}" for b in path]}) + "\n")
    return p


def chained_trace(tmp_path: Path, seed: int, n: int = 150) -> Path:
    """Prefix-chained block ids (as Mooncake's hash_ids are), partial last blocks, outputs."""
    rng = random.Random(seed)
    rows = [
        {"timestamp": i, "input_length": n_in, "output_length": rng.randrange(0, 3 * BS),
         "hash_ids": path}
        for i, (path, n_in) in enumerate(random_reqs(rng, n, aligned=False))
    ]
    p = tmp_path / f"chained{seed}.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def assert_arrays_equal(a: PageArrays, b: PageArrays) -> None:
    for f in ("pages", "offsets", "n_lookup", "input_len", "output_len"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert a.page_size == b.page_size


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("ignore_output", [False, True])
def test_streamed_arrays_equal_layout(tmp_path: Path, seed: int, page_size: int,
                                      ignore_output: bool) -> None:
    path = block_trace(tmp_path, seed)
    whole = read_trace(path, block_size=16)
    sink = BlockSink()
    tr = read_trace(path, block_size=16, sink=sink)
    got = sink.arrays(tr, page_size, ignore_output=ignore_output)
    want = from_trace(whole, page_size, ignore_output=ignore_output)
    assert_arrays_equal(got, want)
    lay = Layout(whole, page_size, ignore_output=ignore_output)
    for i, req in enumerate(whole.requests):
        pr = lay.paged(req)
        assert got.path(i).tolist() == pr.pages and got.n_lookup[i] == pr.n_lookup


def test_streamed_lmcache_is_in_timestamp_order(tmp_path: Path) -> None:
    path = lmcache_trace(tmp_path, 0)
    whole = read_trace(path)
    tr, got = streamed(path, BS)
    assert_arrays_equal(got, from_trace(whole, BS))
    assert tr.format == "lmcache" and tr.count == 150


def test_stream_keeps_the_first_bad_line(tmp_path: Path) -> None:
    path = block_trace(tmp_path, 0)
    lines = path.read_text().splitlines()
    lines.insert(6, '{"timestamp": 1, "input_length": 3, "hash_ids": [1, "x"]}')
    path.write_text("\n".join(lines) + "\n")
    from tools.hitrate.traces import TraceError

    with pytest.raises(TraceError) as e:
        read_trace(path, block_size=16, sink=BlockSink())
    assert e.value.line == 7


def _reference(trace: Trace, page_size: int, ignore_output: bool = False) -> list:
    return Layout(trace, page_size, ignore_output=ignore_output).all_paged()


def _compare_stack(arrs: PageArrays, paged: list, page_size: int, order: str) -> None:
    ref = mrc.stack_distances(paged, page_size, order=order, keep_distances=True)
    got = fast.stack_distances(arrs, order=order, keep_distances=True)
    assert got.distances == ref.distances
    assert {d: int(v) for d, v in enumerate(got.tok_at) if v} == ref.hit_tokens_at
    assert {d: int(v) for d, v in enumerate(got.req_at) if v} == ref.hit_requests_at
    assert {d: int(v) for d, v in enumerate(got.reuse_at) if v} == ref.reuse_pages_at
    assert (got.cold_pages, got.max_pages) == (ref.cold_pages, ref.max_pages)
    assert got.curve() == ref.curve()
    assert got.reuse_buckets() == mrc.reuse_histogram(ref)
    assert got.saturation_pages == ref.saturation_pages
    assert mrc.mrc_points(got, 12) == mrc.mrc_points(ref, 12)
    for c in range(0, got.max_pages + 3):
        assert got.hit_tokens(c) == ref.hit_tokens(c), c
        assert got.hit_requests(c) == ref.hit_requests(c), c
    for rate in (0.0, 0.05, 0.2, 0.5, 0.99):
        assert got.capacity_for(rate) == ref.capacity_for(rate), rate
    assert got.hit_tokens(float("inf")) == ref.unbounded_hit_tokens


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("order", ["tree", "flat"])
@pytest.mark.parametrize("maker", [block_trace, chained_trace])
def test_fast_equals_reference_on_block_traces(tmp_path: Path, seed: int, order: str,
                                               maker: object) -> None:
    bs = 16 if maker is block_trace else BS
    tr = read_trace(maker(tmp_path, seed), block_size=bs)  # type: ignore[operator]
    for ps in (p for p in (1, 4, 16) if bs % p == 0):
        paged = _reference(tr, ps)
        arrs = from_trace(tr, ps)
        _compare_stack(arrs, paged, ps, order)
        assert fast.sharing(arrs) == mrc.sharing(paged, ps)
        biggest = max(len(p.pages) for p in paged)
        caps = [1, 2, biggest, biggest + 3, 2 * biggest, 60, 10_000]
        assert fast_replay.belady(arrs, caps) == [mrc.belady(paged, ps, c) for c in caps]


@pytest.mark.parametrize("seed", range(3))
def test_fast_equals_reference_on_token_traces(tmp_path: Path, seed: int) -> None:
    tr = read_trace(engine_trace(tmp_path, seed))
    for ignore_output in (False, True):
        paged = _reference(tr, 4, ignore_output)
        arrs = from_trace(tr, 4, ignore_output=ignore_output)
        _compare_stack(arrs, paged, 4, "tree")
        assert fast.sharing(arrs) == mrc.sharing(paged, 4)
        caps = [3, 8, 20, 50, 400]
        assert fast_replay.belady(arrs, caps) == [mrc.belady(paged, 4, c) for c in caps]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tiers", TIERS)
@pytest.mark.parametrize("page_size", [4, 16])
def test_replay_of_arrays_equals_replay(tmp_path: Path, seed: int, tiers: dict,
                                        page_size: int) -> None:
    """Every tier mix of test_replay_modes (evictions on device, host and storage, outputs
    inserted): the streamed replay gives the same hits request for request and counters."""
    tr_whole = read_trace(block_trace(tmp_path, seed), block_size=16)
    _, arrs = streamed(block_trace(tmp_path, seed), page_size, block_size=16)
    a = replay(tr_whole, TierConfig(page_size=page_size, **tiers))
    b = replay_arrays(arrs, TierConfig(page_size=page_size, **tiers))
    assert a.per_request_hits == b.per_request_hits
    assert (a.device_hit_tokens, a.host_hit_tokens, a.storage_hit_tokens, a.capped_tokens) == (
        b.device_hit_tokens, b.host_hit_tokens, b.storage_hit_tokens, b.capped_tokens)
    drop = ("prefetch_seconds", "storage_backup_seconds")
    assert {k: v for k, v in a.cache_stats.items() if k not in drop} == {
        k: v for k, v in b.cache_stats.items() if k not in drop}


@pytest.mark.parametrize("seed", range(4))
def test_fast_mrc_equals_exact_replays(tmp_path: Path, seed: int) -> None:
    """One page per request (whole-node eviction is page eviction): the compiled one-pass curve
    equals a separate HiRadixCache run at every capacity, hit tokens and hit requests."""
    rng = random.Random(seed)
    tr = trace_of(tmp_path, [([rng.randrange(30)], 0) for _ in range(300)])
    arrs = from_trace(tr, BS)
    res = fast.stack_distances(arrs)
    for cap in range(1, 32):
        real = replay(tr, TierConfig(page_size=BS, device_pages=cap))
        assert (real.hit_tokens, real.hit_requests) == (res.hit_tokens(cap),
                                                        res.hit_requests(cap)), cap


@pytest.mark.parametrize("seed", range(4))
def test_fast_bounds_equal_exact_replay(tmp_path: Path, seed: int) -> None:
    """Shared prefixes, partial last blocks, outputs inserted: with room for every page the
    exact replay (device only, and device + host + storage) hits exactly the compiled unbounded
    bound and OPT at that size; with less room no tier mix or policy beats OPT."""
    path = chained_trace(tmp_path, seed)
    tr = read_trace(path, block_size=BS)
    _, arrs = streamed(path, 4, block_size=BS)
    res = fast.stack_distances(arrs)
    full = replay_arrays(arrs, TierConfig(page_size=4, device_pages=None))
    biggest = int(np.diff(arrs.offsets).max())
    tiered = replay(tr, TierConfig(page_size=4, device_pages=2 * biggest,
                                   host_pages=4 * biggest, storage_pages=None,
                                   load_back_threshold=0, prefetch_threshold=0))
    assert full.hit_tokens == tiered.hit_tokens == res.unbounded_hit_tokens
    assert tiered.storage_hit_tokens > 0 and tiered.host_hit_tokens > 0
    assert fast_replay.belady(arrs, [res.max_pages])[0].hit_tokens == res.unbounded_hit_tokens
    for tiers in TIERS:
        real = replay_arrays(arrs, TierConfig(page_size=4, **tiers))
        cap = TierConfig(page_size=4, **tiers).total_pages()
        if cap != float("inf"):
            assert real.hit_tokens <= fast_replay.belady(arrs, [int(cap)])[0].hit_tokens
        assert real.hit_tokens <= res.unbounded_hit_tokens


def test_reference_trace_fast(mooncake_trace: Path) -> None:
    tr, arrs = streamed(mooncake_trace, 512)
    res = fast.stack_distances(arrs)
    assert res.unbounded_hit_tokens == 54_098_411 and res.input_tokens == 144_793_823
    assert fast_replay.belady(arrs, [res.max_pages])[0].hit_tokens == 54_098_411
    paged = Layout(read_trace(mooncake_trace), 512).all_paged()
    assert fast.sharing(arrs) == mrc.sharing(paged, 512)
    assert fast_replay.belady(arrs, [2000]) == [mrc.belady(paged, 512, 2000)]


@pytest.mark.parametrize("warmup", [0.25, 0.5])
def test_warmup_counts_only_the_measured_requests(tmp_path: Path, warmup: float) -> None:
    _, arrs = streamed(chained_trace(tmp_path, 5), 4, block_size=BS)
    full = fast.stack_distances(arrs, keep_distances=True)
    warm = fast.stack_distances(arrs, warmup=warmup)
    start = int(arrs.requests * warmup)
    assert full.distances is not None
    assert warm.requests == arrs.requests - start
    assert warm.input_tokens == int(arrs.input_len[start:].sum())
    for cap in (1, 5, 20, 80, full.max_pages):
        want = sum(min(4 * sum(1 for d in ds if d <= cap), int(arrs.input_len[r]))
                   for r, ds in enumerate(full.distances) if r >= start)
        assert warm.hit_tokens(cap) == want, cap
        opt = fast_replay.belady(arrs, [cap], warmup=warmup)[0]
        paged_all = fast_replay.belady(arrs, [cap])[0]
        assert opt.hit_tokens <= paged_all.hit_tokens
    with pytest.raises(ValueError, match="warm-up"):
        fast.stack_distances(arrs, warmup=1.0)


def test_stream_densifies_raw_hash_ids_in_order_of_first_appearance(tmp_path: Path) -> None:
    """The streamed reader hands raw Mooncake ids (huge ones too) to the sink, which numbers
    them as the reader's dict does: the arrays equal those of the non-streamed read."""
    big = [2**70 + 5, 2**63, 2**63 - 1, 7]
    rows = [
        {"timestamp": 0, "input_length": 8, "output_length": 3, "hash_ids": [big[0], big[1]]},
        {"timestamp": 1, "input_length": 12, "output_length": 0, "hash_ids": [big[0], 9, 3]},
        {"timestamp": 2, "input_length": 8, "output_length": 9, "hash_ids": [big[2], big[3]]},
        {"timestamp": 3, "input_length": 9, "output_length": 1, "hash_ids": [big[0], 9, 3]},
    ]
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    whole = read_trace(path, block_size=4)
    tr, got = streamed(path, 4, block_size=4)
    assert tr.num_blocks == 0 and whole.num_blocks == 6
    assert_arrays_equal(got, from_trace(whole, 4))
    # request 0: its blocks, then the one page of its unique token + 3 outputs (ids from 7 up)
    assert got.pages[:6].tolist() == [0, 1, 7, 0, 2, 3] and got.path(2).tolist() == [4, 5, 8, 9]


def test_a_huge_id_after_small_ones_is_appended_once(tmp_path: Path) -> None:
    """`array.extend` keeps what it appended before an id overflowed int64: those ids are not
    appended twice (the arrays equal the non-streamed read's)."""
    buf: array[int] = array("q", [5])
    big: dict[int, int] = {}
    extend_ids(buf, [9, 3, 2**64, 2**64 + 1, 2**64], big)
    assert buf.tolist() == [5, 9, 3, -1, -2, -1]
    rows = [
        {"timestamp": 0, "input_length": 12, "output_length": 1, "hash_ids": [9, 3, 2**70]},
        {"timestamp": 1, "input_length": 16, "output_length": 0, "hash_ids": [9, 3, 2**70, 4]},
    ]
    path = tmp_path / "late.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tr, got = streamed(path, 4, block_size=4)
    assert_arrays_equal(got, from_trace(read_trace(path, block_size=4), 4))
    assert got.path(0).tolist()[:3] == [0, 1, 2] and got.path(1).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("seed", range(6))
def test_tree_lru_equals_exact_replay(tmp_path: Path, seed: int) -> None:
    """The compiled device-only LRU of HiRadixCache gives the replay's hits request for request
    totals (tokens, requests) and its evictions, at every capacity from one request's pages up,
    on prefix-chained traces with partial blocks and outputs inserted."""
    path = chained_trace(tmp_path, 20 + seed, n=200)
    for ps, ignore_output in ((4, False), (1, False), (4, True)):
        sink = BlockSink()
        tr = read_trace(path, block_size=BS, sink=sink)
        arrs = sink.arrays(tr, ps, ignore_output=ignore_output)
        biggest = int(np.diff(arrs.offsets).max())
        caps = sorted({1, 2, biggest // 2 or 1, biggest, biggest + 1, 2 * biggest, 3 * biggest,
                       50, 120, 400, 2000})
        got = fast_replay.tree_lru(arrs, caps, threads=2)
        for c, g in zip(caps, got):
            real = replay_arrays(arrs, TierConfig(page_size=ps, device_pages=c))
            assert (g.hit_tokens, g.hit_requests) == (real.hit_tokens, real.hit_requests), (ps, c)
            assert g.evicted_pages * ps == real.cache_stats["evicted_tokens"], (ps, c)
        stack = fast.stack_distances(arrs)
        assert all(g.hit_tokens <= stack.hit_tokens(g.capacity_pages) for g in got)


def test_tree_lru_on_the_reference_trace(mooncake_trace: Path) -> None:
    _, arrs = streamed(mooncake_trace, 512)
    for c, g in zip((1024, 4096), fast_replay.tree_lru(arrs, [1024, 4096])):
        real = replay_arrays(arrs, TierConfig(page_size=512, device_pages=c))
        assert (g.hit_tokens, g.hit_requests) == (real.hit_tokens, real.hit_requests)
    assert fast_replay.tree_lru(arrs, [4096])[0].hit_tokens == 12_878_070


def test_sampled_curve_at_rate_one_is_the_exact_curve(tmp_path: Path) -> None:
    _, arrs = streamed(chained_trace(tmp_path, 7), 4, block_size=BS)
    exact = fast.stack_distances(arrs)
    samp = fast.sampled_stack(arrs, 1.0)
    assert samp.sampled_refs == len(arrs.pages)
    for c in range(0, exact.max_pages + 2):
        assert samp.hit_tokens(c) == pytest.approx(exact.hit_tokens(c), abs=1e-6), c
    with pytest.raises(ValueError, match="sample rate"):
        fast.sampled_stack(arrs, 0.0)


def test_sampled_curve_error_on_the_reference_trace(mooncake_trace: Path) -> None:
    """Sampling 10% of the pages of the Mooncake trace stays within 0.01 of the exact curve
    at every point of a 15-point MRC (measured: see docs/hitrate.md)."""
    _, arrs = streamed(mooncake_trace, 512)
    exact = fast.stack_distances(arrs)
    samp = fast.sampled_stack(arrs, 0.1)
    assert 0.1 * len(arrs.pages) < samp.sampled_refs < 0.25 * len(arrs.pages)  # hot pages too
    n_in = exact.input_tokens
    errs = [abs(samp.hit_tokens(c) - exact.hit_tokens(c)) / n_in
            for c in mrc.mrc_points(exact, 15)]
    assert max(errs) < 0.01, errs


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("warmup", [0.0, 0.4])
def test_device_lru_equals_exact_replay(tmp_path: Path, seed: int, warmup: float) -> None:
    """`fast_replay.device_lru` (what `--replay-engine compiled` runs) gives the HiRadixCache
    replay's result, unbounded and bounded: hit tokens, hit requests, capped tokens,
    evictions, on prefix-chained traces with partial blocks and outputs inserted."""
    path = chained_trace(tmp_path, 40 + seed, n=200)
    _, arrs = streamed(path, 4, block_size=BS)
    biggest = int(np.diff(arrs.offsets).max())
    for dev in (None, biggest, 3 * biggest, 200):
        real = replay_arrays(arrs, TierConfig(page_size=4, device_pages=dev), warmup=warmup)
        got = fast_replay.device_lru(arrs, dev, warmup=warmup)
        for f in ("requests", "input_tokens", "device_hit_tokens", "hit_requests",
                  "capped_tokens"):
            assert getattr(got, f) == getattr(real, f), (dev, f)
        assert got.cache_stats["evicted_tokens"] == real.cache_stats["evicted_tokens"], dev
        assert got.capped_tokens > 0  # partial last blocks: hits past the input are cut
