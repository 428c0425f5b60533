"""Belady's prefix-aware optimum and `HiRadixCache`'s exact device-only LRU over `PageArrays`,
compiled with numba, one pass per capacity (see `fast.py` for the one-pass analyses)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numba import njit

from tools.hitrate.arrays import PageArrays
from tools.hitrate.fast import warmup_start
from tools.hitrate.mrc import OptResult

if TYPE_CHECKING:
    from tools.hitrate.simulate import SimResult


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
                    hk, hp, hsize, hcap = _reheap(hk, hp, w, hcap)
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
    capped = 0
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
            capped += ps * k - h
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
    return hit_tokens, hit_requests, evicted, capped


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
    return _reheap(hk, hp, w, hcap)


@njit(cache=True)
def _reheap(hk, hp, w, hcap):  # type: ignore[no-untyped-def]
    """The heap's first `w` entries are its live ones: double its arrays when those fill half,
    and heap them again. Returns (keys, pages, size, capacity)."""
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
    capped_tokens: int = 0  # hits past the input length (partial last blocks), not counted


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
        t, r, ev, cp = _tree_lru(arrs.pages, arrs.offsets, arrs.n_lookup, arrs.input_len,
                             np.int64(arrs.page_size), np.int64(arrs.num_pages), np.int64(c),
                             np.int64(start), par)
        return LruResult(int(c), int(t), int(r), int(ev), int(cp))

    todo = sorted(set(int(c) for c in capacities))
    workers = max(1, min(len(todo), threads))
    if workers == 1:
        done = {c: one(c) for c in todo}
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(workers) as pool:
            done = dict(zip(todo, pool.map(one, todo)))
    return [done[int(c)] for c in capacities]


@njit(cache=True)
def _unbounded(pages, off, n_lookup, input_len, ps, num_pages, start):  # type: ignore[no-untyped-def]
    """Unbounded device: a request hits its leading lookup pages inserted before (nothing is
    ever evicted). Returns (hit tokens, hit requests, capped tokens) of the measured requests."""
    seen = np.zeros(num_pages, np.bool_)
    hit_tokens = 0
    hit_requests = 0
    capped = 0
    for r in range(len(n_lookup)):
        o = off[r]
        if r >= start:
            k = 0
            while k < n_lookup[r] and seen[pages[o + k]]:
                k += 1
            h = min(ps * k, input_len[r])
            hit_tokens += h
            capped += ps * k - h
            if h:
                hit_requests += 1
        for idx in range(o, off[r + 1]):
            seen[pages[idx]] = True
    return hit_tokens, hit_requests, capped


def device_lru(arrs: PageArrays, device_pages: int | None, *, warmup: float = 0.0) -> SimResult:
    """`simulate.replay_arrays` of a device-only LRU configuration (no host, no storage tier),
    compiled: `tree_lru` at `device_pages`, or with an unbounded device (None) the pages seen
    before. The same hit tokens, hit requests and capped tokens as the replay (tests); no
    per-request hits and none of HiRadixCache's counters (`cache_stats` holds the evictions)."""
    from tools.hitrate.simulate import SimResult

    start = warmup_start(arrs, warmup)
    if device_pages is None:
        t, r, cp = _unbounded(arrs.pages, arrs.offsets, arrs.n_lookup, arrs.input_len,
                              np.int64(arrs.page_size), np.int64(arrs.num_pages), np.int64(start))
        ev, pages = 0, arrs.num_pages
    else:
        x = tree_lru(arrs, [device_pages], warmup=warmup)[0]
        t, r, cp, ev, pages = x.hit_tokens, x.hit_requests, x.capped_tokens, x.evicted_pages, \
            device_pages
    return SimResult(requests=arrs.requests - start,
                     input_tokens=int(arrs.input_len[start:].sum()), device_hit_tokens=int(t),
                     hit_requests=int(r), capped_tokens=int(cp),
                     cache_stats={"evicted_tokens": int(ev) * arrs.page_size},
                     device_pages=int(pages))
