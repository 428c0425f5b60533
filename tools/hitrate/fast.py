"""The one-pass analyses of `mrc.py` over `PageArrays`, compiled with numba.

Same algorithms, same accounting, same tie-breaks as `mrc.py` (the readable reference, kept for
the tests): LRU stack distances (tree or flat order) for the miss-ratio curve, the reuse
distances and the unbounded bound; Belady's prefix-aware optimum; prefix sharing. Each kernel
runs over flat int64 arrays indexed by page id, so its memory is a few arrays of `num_pages` and
of the page references, and its speed is that of a loop in C. `tests/tools/test_fast.py` checks
every result against `mrc.py` and against the exact replay through `HiRadixCache`.

Why numba (docs/hitrate.md, "Speed"): the algorithms are sequential loops with data-dependent
branches (a Fenwick tree, a heap with lazy deletion) that numpy cannot vectorise; numba compiles
them from this file with no build step, is already installed with lmcache, and caches the
machine code next to the module (`cache=True`), so only the first run pays the compile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from tools.hitrate.arrays import PageArrays
from tools.hitrate.mrc import OptResult, Sharing

# --- layout helpers (used by arrays.py) --------------------------------------------------------


@njit(cache=True)
def _block_paths(blocks, boff, m, n_extra, base):  # type: ignore[no-untyped-def]
    n = len(n_extra)
    off = np.zeros(n + 1, np.int64)
    for i in range(n):
        off[i + 1] = off[i] + (boff[i + 1] - boff[i]) * m + n_extra[i]
    pages = np.empty(off[n], np.int64)
    nxt = base
    k = 0
    for i in range(n):
        for bi in range(boff[i], boff[i + 1]):
            b = blocks[bi]
            for j in range(m):
                pages[k] = b * m + j
                k += 1
        for _ in range(n_extra[i]):
            pages[k] = nxt
            nxt += 1
            k += 1
    return pages, off, nxt


def block_paths(
    blocks: np.ndarray, boff: np.ndarray, m: int, n_extra: np.ndarray, base: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """(pages, offsets, num_pages) of block paths: block b -> pages b*m .. b*m+m-1, then the
    request's `n_extra` unique pages, numbered from `base` in request order."""
    pages, off, nxt = _block_paths(blocks, boff, np.int64(m), n_extra, np.int64(base))
    num = int(nxt) if len(pages) == 0 else max(int(nxt), int(pages.max()) + 1)
    return pages, off, num


@njit(cache=True)
def _gather_segments(data, off, order):  # type: ignore[no-untyped-def]
    n = len(order)
    new_off = np.zeros(n + 1, np.int64)
    for i in range(n):
        r = order[i]
        new_off[i + 1] = new_off[i] + off[r + 1] - off[r]
    out = np.empty(new_off[n], data.dtype)
    for i in range(n):
        r = order[i]
        out[new_off[i] : new_off[i + 1]] = data[off[r] : off[r + 1]]
    return out, new_off


def gather_segments(
    data: np.ndarray, off: np.ndarray, order: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Segments `data[off[r]:off[r+1]]` for r in `order`, concatenated, with their offsets."""
    return _gather_segments(data, off, order.astype(np.int64))


@njit(cache=True)
def _dense_in_place(ids, slots):  # type: ignore[no-untyped-def]
    """Renumbers `ids` in place 0, 1, ... by first appearance with an open-addressing table of
    `slots` (a power of two), doubled whenever it is two-thirds full; returns the count."""
    keys = np.empty(slots, np.int64)
    vals = np.full(slots, -1, np.int64)
    firsts = np.empty(slots, np.int64)  # id of each number, to rebuild the table on growth
    n = 0
    for i in range(len(ids)):
        if 3 * n >= 2 * slots:
            slots *= 2
            keys = np.empty(slots, np.int64)
            vals = np.full(slots, -1, np.int64)
            grown = np.empty(slots, np.int64)
            grown[:n] = firsts[:n]
            firsts = grown
            for v in range(n):
                h = (firsts[v] * np.int64(-7046029254386353131)) & (slots - 1)
                while vals[h] >= 0:
                    h = (h + 1) & (slots - 1)
                keys[h] = firsts[v]
                vals[h] = v
        mask = slots - 1
        x = ids[i]
        h = (x * np.int64(-7046029254386353131)) & mask  # Fibonacci hashing (wraps)
        while True:
            v = vals[h]
            if v < 0:
                keys[h] = x
                vals[h] = n
                firsts[n] = x
                ids[i] = n
                n += 1
                break
            if keys[h] == x:
                ids[i] = v
                break
            h = (h + 1) & mask
    return n


@njit(cache=True)
def _dense_direct(ids, top):  # type: ignore[no-untyped-def]
    table = np.full(top + 1, -1, np.int64)
    n = 0
    for i in range(len(ids)):
        x = ids[i]
        v = table[x]
        if v < 0:
            v = table[x] = n
            n += 1
        ids[i] = v
    return n


def dense_in_place(ids: np.ndarray) -> int:
    """`ids` (int64, writable) renumbered in place by first appearance; the distinct count.
    Ids that are small non-negative integers (at most 4 per reference: Mooncake's are dense)
    are numbered through a table indexed by id (8 bytes per id value); others through a hash
    table (24 bytes per slot, at most 3 slots per distinct id)."""
    if not len(ids):
        return 0
    lo, hi = int(ids.min()), int(ids.max())
    if lo >= 0 and hi < 4 * len(ids) + 1024:
        return int(_dense_direct(ids, np.int64(hi)))
    return int(_dense_in_place(ids, np.int64(1 << 16)))


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
            t = last[p]
            if t >= 0:
                j = t + 1
                while j <= size:
                    tree[j] -= w[p]
                    j += j & -j
                live -= w[p]
            j = clock + 1
            while j <= size:
                tree[j] += w[p]
                j += j & -j
            live += w[p]
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


# --- Belady ------------------------------------------------------------------------------------


@njit(cache=True)
def _next_uses(pages, off, n_lookup, num_pages, nu):  # type: ignore[no-untyped-def]
    """Per page reference: the next request after this one whose lookup covers the page (n:
    none). Returns whether every such dead reference is also the page's last appearance."""
    n = len(n_lookup)
    nxt = np.full(num_pages, n, nu.dtype)
    seen = np.zeros(num_pages, np.bool_)  # appears in a later path
    final = True
    for r in range(n - 1, -1, -1):
        o = off[r]
        for idx in range(o, off[r + 1]):
            p = pages[idx]
            nu[idx] = nxt[p]
            if nu[idx] == n and seen[p]:
                final = False
        for idx in range(o, off[r + 1]):
            seen[pages[idx]] = True
        for i in range(n_lookup[r]):
            nxt[pages[o + i]] = r
    return final


@njit(cache=True, inline="always")
def _before(ka, pa, kb, pb):  # type: ignore[no-untyped-def]
    # a leaves before b: later next use (then deeper) first; ties on the smaller page id
    return ka > kb or (ka == kb and pa < pb)


@njit(cache=True)
def _heap_push(hk, hp, size, k, p):  # type: ignore[no-untyped-def]
    i = size
    hk[i] = k
    hp[i] = p
    while i > 0:
        parent = (i - 1) >> 1
        if _before(hk[i], hp[i], hk[parent], hp[parent]):
            hk[i], hk[parent] = hk[parent], hk[i]
            hp[i], hp[parent] = hp[parent], hp[i]
            i = parent
        else:
            break
    return size + 1


@njit(cache=True)
def _heap_pop(hk, hp, size):  # type: ignore[no-untyped-def]
    size -= 1
    hk[0] = hk[size]
    hp[0] = hp[size]
    i = 0
    while True:
        a = 2 * i + 1
        if a >= size:
            break
        b = a + 1
        c = a
        if b < size and _before(hk[b], hp[b], hk[a], hp[a]):
            c = b
        if _before(hk[c], hp[c], hk[i], hp[i]):
            hk[i], hk[c] = hk[c], hk[i]
            hp[i], hp[c] = hp[c], hp[i]
            i = c
        else:
            break
    return size


@njit(cache=True, nogil=True)
def _belady(pages, off, n_lookup, input_len, ps, num_pages, cap, nu, depth_mult, start,  # type: ignore[no-untyped-def]
            dead_final):
    # dead_final: a page with no future use never appears again, so which of them stay cached
    # cannot matter (they leave first, before any page with a future use): they are a count,
    # never pushed on the heap.
    n = len(n_lookup)
    dead = 0
    key = np.full(num_pages, -1, np.int64)  # cached page -> next use * depth_mult + depth
    count = 0
    hcap = 1024
    hk = np.empty(hcap, np.int64)
    hp = np.empty(hcap, np.int64)
    hsize = 0
    hit_tokens = 0
    hit_requests = 0
    hit_pages = 0
    never = n * depth_mult  # keys from here up: pages with no future use
    lost = 0  # evictions of pages that had a future use
    for r in range(n):
        o = off[r]
        k = 0
        while k < n_lookup[r] and key[pages[o + k]] >= 0:
            k += 1
        if k and r >= start:
            hit_pages += k
            hit_tokens += min(ps * k, input_len[r])
            hit_requests += 1
        for depth in range(off[r + 1] - o):
            p = pages[o + depth]
            if dead_final and nu[o + depth] == n:
                if key[p] >= 0:
                    key[p] = -1  # leaves the heap's live set (its entry goes stale)
                else:
                    count += 1
                dead += 1
                continue
            e = np.int64(nu[o + depth]) * depth_mult + depth
            if key[p] != e:
                if key[p] < 0:
                    count += 1
                key[p] = e
                if hsize == hcap:
                    # drop stale entries first; grow only if the live ones fill it
                    w = 0
                    for q in range(hsize):
                        if key[hp[q]] == hk[q]:
                            hk[w] = hk[q]
                            hp[w] = hp[q]
                            w += 1
                    if w * 2 > hcap:
                        hcap *= 2
                        nk = np.empty(hcap, np.int64)
                        npg = np.empty(hcap, np.int64)
                        nk[:w] = hk[:w]
                        npg[:w] = hp[:w]
                        hk = nk
                        hp = npg
                    hsize = 0
                    for q in range(w):
                        hsize = _heap_push(hk, hp, hsize, hk[q], hp[q])
                hsize = _heap_push(hk, hp, hsize, e, p)
        while count > cap and dead:
            dead -= 1
            count -= 1
        while count > cap:
            e = hk[0]
            p = hp[0]
            hsize = _heap_pop(hk, hp, hsize)
            if key[p] == e:
                key[p] = -1
                count -= 1
                if e < never:
                    lost += 1
    return hit_tokens, hit_requests, hit_pages, lost


def belady(
    arrs: PageArrays, capacities: list[int], *, warmup: float = 0.0, threads: int = 1
) -> list[OptResult]:
    """`mrc.belady` over arrays, at each capacity (pages); the next uses are computed once and
    the capacities run on `threads` threads (the kernel releases the GIL; the default is one:
    on a shared 2-core machine two threads were slower than one, each pass being bound by
    memory latency).
    `warmup`: as in `stack_distances`."""
    start = warmup_start(arrs, warmup)
    if not arrs.requests:
        return [OptResult(c, 0, 0, 0) for c in capacities]
    nu = np.empty(len(arrs.pages), np.int32 if arrs.requests < 2**31 - 1 else np.int64)
    dead_final = bool(
        _next_uses(arrs.pages, arrs.offsets, arrs.n_lookup, np.int64(arrs.num_pages), nu))
    depth_mult = int(np.diff(arrs.offsets).max()) + 1

    todo = sorted(set(int(c) for c in capacities))
    done: dict[int, tuple[int, int, int]] = {}
    saturated: list[int] = []  # capacities at which no page with a future use was evicted

    def task(c: int) -> None:
        below = [s for s in saturated if s <= c]
        if below:  # OPT at a smaller size lost nothing: so does every larger size
            done[c] = done[min(below)]
            return
        t, r, p, lost = _belady(arrs.pages, arrs.offsets, arrs.n_lookup, arrs.input_len,
                                np.int64(arrs.page_size), np.int64(arrs.num_pages), np.int64(c),
                                nu, np.int64(depth_mult), np.int64(start), dead_final)
        done[c] = (int(t), int(r), int(p))
        if not lost:
            saturated.append(c)

    workers = max(1, min(len(todo), threads))
    if workers == 1:
        for c in todo:
            task(c)
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(task, todo))
    return [OptResult(int(c), *done[int(c)]) for c in capacities]


# --- sharing -----------------------------------------------------------------------------------


@njit(cache=True)
def _sharing(pages, off, n_lookup, input_len, ps, num_pages):  # type: ignore[no-untyped-def]
    n = len(n_lookup)
    users = np.zeros(num_pages, np.int64)
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


# --- exact LRU of HiRadixCache (device only) ---------------------------------------------------


@njit(cache=True, nogil=True)
def _tree_lru(pages, off, n_lookup, input_len, ps, num_pages, cap, start, par):  # type: ignore[no-untyped-def]
    """HiRadixCache's device-only LRU replayed page by page (see `tree_lru`)."""
    n = len(n_lookup)
    # 13 bytes a page: flags, cached children, last access, node id (`par` is shared)
    cached = np.zeros(num_pages, np.bool_)
    end = np.zeros(num_pages, np.bool_)  # the page ends its node
    nch = np.zeros(num_pages, np.int32)  # cached child pages
    last = np.zeros(num_pages, np.int32)  # the node's last access (a logical clock, 2 a request)
    nid = np.zeros(num_pages, np.int32)  # node id, on the node's end page (3 a request at most)
    mult = np.int64(3 * n + 4)  # node ids stay below this (a new node and two splits a request)
    hcap = 1024
    hk = np.empty(hcap, np.int64)
    hp = np.empty(hcap, np.int64)
    hsize = 0
    tick = 0
    ids = 0
    n_cached = 0
    hit_tokens = 0
    hit_requests = 0
    evicted = 0
    for r in range(n):
        o = off[r]
        L = off[r + 1] - o
        nl = n_lookup[r]
        # acquire: the leading cached lookup pages; split the node the match ends inside
        k = 0
        while k < nl and cached[pages[o + k]]:
            k += 1
        if k and not end[pages[o + k - 1]]:
            end[pages[o + k - 1]] = True
            ids += 1
            nid[pages[o + k - 1]] = ids
        tick += 1
        locked = tick  # the matched path is locked: its pages, and only they, bear this tick
        for i in range(k):
            last[pages[o + i]] = tick
        if r >= start:
            h = min(ps * k, input_len[r])
            hit_tokens += h
            if h:
                hit_requests += 1
        # alloc: evict least recently used unlocked leaf nodes, whole, until the pages fit
        need = L - k
        while need > cap - n_cached:
            if hsize == 0:
                break
            key = hk[0]
            e = hp[0]
            hsize = _heap_pop(hk, hp, hsize)
            if not (cached[e] and end[e] and nch[e] == 0 and last[e] != locked
                    and key == -(np.int64(last[e]) * mult + nid[e])):
                continue
            x = e
            while True:
                cached[x] = False
                end[x] = False
                nch[x] = 0
                n_cached -= 1
                evicted += 1
                x = par[x]
                if x < 0 or end[x]:
                    break
            if x >= 0:
                nch[x] -= 1
                if nch[x] == 0 and last[x] != locked:
                    if hsize == hcap:
                        hk, hp, hsize, hcap = _lru_room(hk, hp, hsize, hcap, cached, end, nch,
                                                        last, nid, mult)
                    hsize = _heap_push(hk, hp, hsize, -(np.int64(last[x]) * mult + nid[x]), x)
        if need > cap - n_cached:
            # no room: the request caches nothing; its release makes its deepest matched node
            # a candidate again if eviction left it a leaf
            if k and nch[pages[o + k - 1]] == 0:
                e = pages[o + k - 1]
                if hsize == hcap:
                    hk, hp, hsize, hcap = _lru_room(hk, hp, hsize, hcap, cached, end, nch, last,
                                                    nid, mult)
                hsize = _heap_push(hk, hp, hsize, -(np.int64(last[e]) * mult + nid[e]), e)
            continue
        # insert: walk the cached part (splitting where the path leaves a node), add the rest
        tick += 1
        i = 0
        while i < L and cached[pages[o + i]]:
            last[pages[o + i]] = tick
            i += 1
        if i and not end[pages[o + i - 1]]:
            # the path ends inside a node, or leaves it here: split after page i-1
            end[pages[o + i - 1]] = True
            ids += 1
            nid[pages[o + i - 1]] = ids
        if i < L:
            if i:
                nch[pages[o + i - 1]] += 1
            for j in range(i, L):
                p = pages[o + j]
                cached[p] = True
                end[p] = False
                nch[p] = 1
                last[p] = tick
            nch[pages[o + L - 1]] = 0
            end[pages[o + L - 1]] = True
            ids += 1
            nid[pages[o + L - 1]] = ids
            n_cached += L - i
        if L:
            e = pages[o + L - 1]
            if hsize == hcap:
                hk, hp, hsize, hcap = _lru_room(hk, hp, hsize, hcap, cached, end, nch, last,
                                                nid, mult)
            hsize = _heap_push(hk, hp, hsize, -(np.int64(last[e]) * mult + nid[e]), e)
    return hit_tokens, hit_requests, evicted


@njit(cache=True)
def _parents(pages, off, par):  # type: ignore[no-untyped-def]
    """The parent page of every page (-1: first on its path); prefix-chained ids have one."""
    for r in range(len(off) - 1):
        for idx in range(off[r] + 1, off[r + 1]):
            par[pages[idx]] = pages[idx - 1]


@njit(cache=True)
def _lru_room(hk, hp, hsize, hcap, cached, end, nch, last, nid, mult):  # type: ignore[no-untyped-def]
    """A full candidate heap: drop its stale entries; double it if the live ones fill half."""
    w = 0
    for q in range(hsize):
        e = hp[q]
        if cached[e] and end[e] and nch[e] == 0 and hk[q] == -(np.int64(last[e]) * mult
                                                               + nid[e]):
            hk[w] = hk[q]
            hp[w] = e
            w += 1
    if w * 2 > hcap:
        hcap *= 2
        nk = np.empty(hcap, np.int64)
        npg = np.empty(hcap, np.int64)
        nk[:w] = hk[:w]
        npg[:w] = hp[:w]
        hk = nk
        hp = npg
    size = 0
    for q in range(w):
        size = _heap_push(hk, hp, size, hk[q], hp[q])
    return hk, hp, size, hcap


@dataclass
class LruResult:
    capacity_pages: int
    hit_tokens: int  # capped at each request's input length, as the replay counts them
    hit_requests: int
    evicted_pages: int


def tree_lru(
    arrs: PageArrays, capacities: list[int], *, warmup: float = 0.0, threads: int = 1
) -> list[LruResult]:
    """The device-only LRU of `HiRadixCache` (page ids, write-through, no host or storage tier),
    compiled: per capacity, the same hits as `simulate.replay_arrays` request for request (one
    pass per capacity, on `threads` threads as in `belady`).

    The tree's state is kept per page: cached, ends its node, parent page, cached children, last
    access and node id. A request matches its leading cached lookup pages (splitting the node the
    match ends inside, which takes a new id, as `RadixTree.split` gives the upper part), touches
    them, evicts least recently used unlocked leaf *nodes* whole (ties on the node id) until its
    new pages fit, or caches nothing when they cannot, then inserts its path as one new node and
    touches the whole path. Page ids must be prefix-chained (one parent per page), as block
    hashes and the interned token pages are. Checked against the replay in tests/tools/test_fast.py.
    """
    start = warmup_start(arrs, warmup)
    if arrs.requests >= 2**29 or len(arrs.pages) >= 2**30:
        raise ValueError("tree_lru counts in int32: at most 2**29 requests and 2**30 pages")
    for c in capacities:
        if c < 1:
            raise ValueError(f"capacity must be >= 1 page, got {c}")
    par = np.full(arrs.num_pages, -1, np.int32 if arrs.num_pages < 2**31 else np.int64)
    _parents(arrs.pages, arrs.offsets, par)

    def one(c: int) -> LruResult:
        t, r, ev = _tree_lru(arrs.pages, arrs.offsets, arrs.n_lookup, arrs.input_len,
                             np.int64(arrs.page_size), np.int64(arrs.num_pages), np.int64(c),
                             np.int64(start), par)
        return LruResult(int(c), int(t), int(r), int(ev))

    todo = sorted(set(int(c) for c in capacities))
    workers = max(1, min(len(todo), threads))
    if workers == 1:
        done = {c: one(c) for c in todo}
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(workers) as pool:
            done = dict(zip(todo, pool.map(one, todo)))
    return [done[int(c)] for c in capacities]
