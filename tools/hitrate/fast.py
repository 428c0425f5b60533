"""The one-pass analyses of `mrc.py` over `PageArrays`, compiled with numba: LRU stack
distances (tree or flat order) for the miss-ratio curve, the reuse distances and the unbounded
bound; the sampled curve (`--sample`); prefix sharing. Belady's optimum and the tree's exact LRU
are in `fast_replay.py`.

Same algorithms, same accounting, same tie-breaks as `mrc.py` (the readable reference, kept for
the tests). Each kernel runs over flat arrays indexed by page id, so its memory is a few arrays
of `num_pages` and of the page references, and its speed is that of a loop in C.
`tests/tools/test_fast.py` checks every result against `mrc.py` and against the exact replay
through `HiRadixCache`.

Why numba (docs/hitrate.md, "Scale"): the algorithms are sequential loops with data-dependent
branches (a Fenwick tree, heaps with lazy deletion) that numpy cannot vectorise; numba compiles
them from this file with no build step, and caches the machine code next to the module
(`cache=True`), so only the first run pays the compile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from tools.hitrate.arrays import PageArrays
from tools.hitrate.mrc import Sharing

# --- stack distances ---------------------------------------------------------------------------


@njit(cache=True)
def _stack(pages, off, n_lookup, input_len, ps, flat, keep, start, last, req_at, reuse_at):  # type: ignore[no-untyped-def]
    # last, req_at, reuse_at come allocated (int32 where the counts allow: see stack_distances)
    n = len(n_lookup)
    num_pages = len(last)
    total = 0
    for r in range(n):
        total += n_lookup[r] if flat else off[r + 1] - off[r]
    tree = np.zeros(total + 2, np.int32)
    tok_at = np.zeros(num_pages + 2, np.int64)
    dist = np.zeros(off[n] if keep else 0, np.int64)  # keep: per lookup page, 0 = cold
    size = total + 1
    live = 0
    clock = 0
    cold = 0
    max_live = 0
    for r in range(n):
        o = off[r]
        nl = n_lookup[r]
        L = input_len[r]
        running = 0
        prev = 0
        for i in range(nl if r >= start else 0):
            t = last[pages[o + i]]
            if t < 0:
                cold += nl - i
                break
            s = 0
            j = t + 1
            while j > 0:
                s += tree[j]
                j -= j & -j
            d = live - s + 1
            if keep:
                dist[o + i] = d
            reuse_at[d] += 1
            if flat:
                if d > running:
                    running = d
                d = running
            tokens = min(ps * (i + 1), L)
            gain = tokens - prev
            prev = tokens
            if gain:
                tok_at[d] += gain
            if i == 0:
                req_at[d] += 1
        end = o + nl if flat else off[r + 1]
        cnt = end - o
        for q in range(cnt):
            idx = o + q if flat else end - 1 - q
            p = pages[idx]
            t = last[p]
            if t >= 0:
                j = t + 1
                while j <= size:
                    tree[j] -= 1
                    j += j & -j
                live -= 1
            j = clock + 1
            while j <= size:
                tree[j] += 1
                j += j & -j
            live += 1
            last[p] = clock
            clock += 1
        if live > max_live:
            max_live = live
    return tok_at, cold, max_live, dist


@njit(cache=True)
def fenwick_move(tree, size, t, clock, wp):  # type: ignore[no-untyped-def]
    """Move a page of weight `wp` in a Fenwick tree of stack positions from position `t` (its
    last use; -1: none) to `clock` (now): the one-pass stack's step for each page used."""
    if t >= 0:
        j = t + 1
        while j <= size:
            tree[j] -= wp
            j += j & -j
    j = clock + 1
    while j <= size:
        tree[j] += wp
        j += j & -j


@njit(cache=True)
def _stack_sampled(pages, off, n_lookup, input_len, ps, num_pages, w):  # type: ignore[no-untyped-def]
    """Tree-order stack distances over the pages of weight w > 0 (see `sampled_stack`): a kept
    lookup page's distance is 1 + the weight of the kept pages touched since it was, and its
    token gain counts with its weight."""
    n = len(n_lookup)
    total = 0
    for idx in range(off[n]):
        if w[pages[idx]] > 0:
            total += 1
    tree = np.zeros(total + 2, np.float64)
    last = np.full(num_pages, -1, np.int64)
    tok_at = np.zeros(num_pages + 2, np.float64)
    size = total + 1
    live = 0.0
    clock = 0
    for r in range(n):
        o = off[r]
        L = input_len[r]
        for i in range(n_lookup[r]):
            p = pages[o + i]
            if w[p] == 0:
                continue
            t = last[p]
            if t < 0:
                break  # later pages of a chained path are cold too
            sm = 0.0
            j = t + 1
            while j > 0:
                sm += tree[j]
                j -= j & -j
            d = int(math.ceil(1.0 + live - sm - 1e-9))
            if d > num_pages + 1:
                d = num_pages + 1
            gain = min(ps * (i + 1), L) - min(ps * i, L)
            tok_at[d] += gain * w[p]
        for q in range(off[r + 1] - o):
            p = pages[off[r + 1] - 1 - q]
            if w[p] == 0:
                continue
            if last[p] < 0:
                live += w[p]
            fenwick_move(tree, size, last[p], clock, w[p])
            last[p] = clock
            clock += 1
    return tok_at, total


@dataclass
class SampledStack:
    """The token hit curve estimated from a spatial sample of pages (`sampled_stack`)."""

    rate: float
    input_tokens: int
    sampled_refs: int  # page references of the sampled pages
    tok_at: np.ndarray  # scaled distance -> estimated tokens gained

    def __post_init__(self) -> None:
        nz = np.flatnonzero(self.tok_at)
        self.tok_at = self.tok_at[: int(nz[-1]) + 1 if len(nz) else 1].copy()
        self.cum_tok = np.cumsum(self.tok_at)

    def hit_tokens(self, capacity_pages: float) -> float:
        if capacity_pages < 0:
            return 0.0
        c = len(self.cum_tok) - 1 if math.isinf(capacity_pages) else min(
            int(capacity_pages), len(self.cum_tok) - 1)
        return float(self.cum_tok[c])

    @property
    def saturation_pages(self) -> int:
        nz = np.flatnonzero(self.tok_at)
        return int(nz[-1]) if len(nz) else 0


def sample_weights(arrs: PageArrays, rate: float) -> np.ndarray:
    """Per page: 1 for a page looked up at least 1/rate times (kept whole), 1/rate for another
    page whose id hash (SplitMix64's finaliser) falls in `rate` of the hash space, else 0."""
    lengths = np.diff(arrs.offsets)
    pos = np.arange(len(arrs.pages), dtype=np.int64) - np.repeat(arrs.offsets[:-1], lengths)
    looked = pos < np.repeat(arrs.n_lookup, lengths)
    del pos
    refs = np.bincount(arrs.pages[looked], minlength=arrs.num_pages)
    del looked
    z = np.arange(arrs.num_pages, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    sampled = (z & np.uint64(0xFFFFFF)) < np.uint64(max(1, round(rate * (1 << 24))))
    w = np.where(refs >= 1.0 / rate, 1.0, np.where(sampled, 1.0 / rate, 0.0))
    return w.astype(np.float64)


def sampled_stack(arrs: PageArrays, rate: float) -> SampledStack:
    """The LRU miss-ratio curve (tree order, token hits) from a sample of the pages: SHARDS'
    spatial sampling at a fixed rate (pages whose id hash falls in `rate` of the hash space,
    each standing for 1/rate pages: in distances and in token gains), except that the pages
    looked up at least 1/rate times are all kept, each for itself. In a prefix tree a few hot
    pages (a shared system prompt) carry much of the hit rate at small capacities; a hash that
    misses one of them shifts the whole curve there (0.04 on the Mooncake trace at 0.1)."""
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"sample rate must be in (0, 1], got {rate}")
    w = sample_weights(arrs, rate)
    tok, total = _stack_sampled(arrs.pages, arrs.offsets, arrs.n_lookup, arrs.input_len,
                                np.int64(arrs.page_size), np.int64(arrs.num_pages), w)
    return SampledStack(rate, arrs.input_tokens, int(total), tok)


@dataclass
class ArrayStack:
    """Distances of one pass as arrays indexed by stack distance (pages); the interface of
    `mrc.StackResult` (curve, hit_tokens, capacity_for, ...)."""

    page_size: int
    input_tokens: int
    requests: int
    tok_at: np.ndarray  # distance -> tokens gained
    req_at: np.ndarray  # distance -> requests gained (their first page's distance)
    reuse_at: np.ndarray  # distance -> re-used lookup pages
    cold_pages: int
    max_pages: int
    distances: list[list[int]] | None = None

    def __post_init__(self) -> None:
        # the arrays end at the largest distance seen (they were sized for every page)
        top = 1
        for a in (self.tok_at, self.req_at, self.reuse_at):
            nz = np.flatnonzero(a)
            top = max(top, int(nz[-1]) + 1 if len(nz) else 1)
        # views, not copies (the largest distance is often near the end); counts stay int32
        # when they were; requests are summed on demand (no second cumulative array)
        self.tok_at, self.req_at, self.reuse_at = (
            a[:top] for a in (self.tok_at, self.req_at, self.reuse_at))
        self.cum_tok = np.cumsum(self.tok_at)

    def _at(self, cum: np.ndarray, capacity_pages: float) -> int:
        if capacity_pages < 0:
            return 0
        c = len(cum) - 1 if math.isinf(capacity_pages) else min(int(capacity_pages), len(cum) - 1)
        return int(cum[c])

    def hit_tokens(self, capacity_pages: float) -> int:
        return self._at(self.cum_tok, capacity_pages)

    def hit_requests(self, capacity_pages: float) -> int:
        if capacity_pages < 0:
            return 0
        c = len(self.req_at) if math.isinf(capacity_pages) else int(capacity_pages) + 1
        return int(self.req_at[:c].sum(dtype=np.int64))

    @property
    def unbounded_hit_tokens(self) -> int:
        return int(self.cum_tok[-1])

    @property
    def unbounded_hit_requests(self) -> int:
        return int(self.req_at.sum(dtype=np.int64))

    @property
    def saturation_pages(self) -> int:
        nz = np.flatnonzero(self.tok_at)
        return int(nz[-1]) if len(nz) else 0

    def curve(self) -> tuple[list[int], list[int], list[int]]:
        ds = np.flatnonzero((self.tok_at != 0) | (self.req_at != 0))
        cum_req = np.cumsum(self.req_at, dtype=np.int64)
        return ds.tolist(), self.cum_tok[ds].tolist(), cum_req[ds].tolist()

    def capacity_for(self, hit_rate: float) -> int | None:
        need = hit_rate * self.input_tokens
        if need <= 0:
            return 0
        i = int(np.searchsorted(self.cum_tok, need - 1e-9, side="left"))
        return None if i >= len(self.cum_tok) else i

    def reuse_buckets(self) -> list[dict[str, int]]:
        ds = np.flatnonzero(self.reuse_at)
        out: list[dict[str, int]] = []
        if not len(ds):
            return out
        b = np.floor(np.log2(ds)).astype(np.int64)
        counts = np.bincount(b, weights=self.reuse_at[ds]).astype(np.int64)
        for k in np.flatnonzero(counts).tolist():
            out.append({"min_pages": 1 << k, "max_pages": (1 << (k + 1)) - 1,
                        "pages": int(counts[k])})
        return out


def warmup_start(arrs: PageArrays, warmup: float) -> int:
    """The first measured request when the first `warmup` fraction of requests only warms the
    cache (floor, as kvcache-simulator counts it)."""
    if not 0.0 <= warmup < 1.0:
        raise ValueError(f"warm-up must be a fraction in [0, 1), got {warmup}")
    return int(math.floor(arrs.requests * warmup))


def stack_distances(
    arrs: PageArrays, *, order: str = "tree", keep_distances: bool = False, warmup: float = 0.0
) -> ArrayStack:
    """`mrc.stack_distances` over arrays (see its docstring). `warmup`: the first fraction of
    requests updates the stack but is not counted (hits, input tokens, requests)."""
    if order not in ("tree", "flat"):
        raise ValueError(f"order must be 'tree' or 'flat', got {order!r}")
    start = warmup_start(arrs, warmup)
    small = np.int32 if len(arrs.pages) < 2**31 - 2 else np.int64  # clocks and counts fit
    last = np.full(arrs.num_pages, -1, small)
    req = np.zeros(arrs.num_pages + 2, small)
    reuse = np.zeros(arrs.num_pages + 2, small)
    tok, cold, max_live, dist = _stack(
        arrs.pages, arrs.offsets, arrs.n_lookup, arrs.input_len, np.int64(arrs.page_size),
        order == "flat", keep_distances, np.int64(start), last, req, reuse,
    )
    del last
    res = ArrayStack(arrs.page_size, int(arrs.input_len[start:].sum()), arrs.requests - start,
                     tok, req, reuse, int(cold), int(max_live))
    if keep_distances:
        res.distances = []
        for i in range(arrs.requests):
            o = int(arrs.offsets[i])
            ds = dist[o : o + int(arrs.n_lookup[i])]
            res.distances.append([int(d) for d in ds if d > 0])
    return res


# --- sharing -----------------------------------------------------------------------------------


@njit(cache=True)
def _sharing(pages, off, n_lookup, input_len, ps, num_pages):  # type: ignore[no-untyped-def]
    n = len(n_lookup)
    users = np.zeros(num_pages, np.int32)  # requests looking a page up (fewer than 2**31)
    first = np.zeros(num_pages, np.bool_)
    refs = 0
    for r in range(n):
        o = off[r]
        refs += n_lookup[r]
        if n_lookup[r]:
            first[pages[o]] = True
        for i in range(n_lookup[r]):
            users[pages[o + i]] += 1
    shared = 0
    n_shared = 0
    fracs = np.zeros(n, np.float64)
    for r in range(n):
        o = off[r]
        k = 0
        while k < n_lookup[r] and users[pages[o + k]] > 1:
            k += 1
        t = min(ps * k, input_len[r])
        shared += t
        if k:
            n_shared += 1
        fracs[r] = t / input_len[r] if input_len[r] else 0.0
    unique = 0
    n_first = 0
    for p in range(num_pages):
        if users[p]:
            unique += 1
        if first[p]:
            n_first += 1
    return unique, refs, shared, n_shared, n_first, fracs


def sharing(arrs: PageArrays) -> Sharing:
    """`mrc.sharing` over arrays."""
    unique, refs, shared, n_shared, n_first, fracs = _sharing(
        arrs.pages, arrs.offsets, arrs.n_lookup, arrs.input_len, np.int64(arrs.page_size),
        np.int64(arrs.num_pages),
    )
    fracs.sort()
    total_in = arrs.input_tokens

    def pct(q: float) -> float:
        if not len(fracs):
            return 0.0
        return float(fracs[min(len(fracs) - 1, max(0, math.ceil(q * len(fracs)) - 1))])

    return Sharing(
        unique_pages=int(unique),
        lookup_page_refs=int(refs),
        shared_prefix_tokens=int(shared),
        shared_prefix_ratio=int(shared) / total_in if total_in else 0.0,
        requests_with_shared_prefix=int(n_shared),
        distinct_first_pages=int(n_first),
        shared_fraction_p50=pct(0.5),
        shared_fraction_p90=pct(0.9),
    )
