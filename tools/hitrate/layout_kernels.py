"""Compiled helpers that lay a trace out as `PageArrays` (used by `arrays.py`): block paths,
segment gathers in a new order, and dense numbering of raw block ids."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _block_paths(blocks, boff, m, n_extra, base, pages):  # type: ignore[no-untyped-def]
    n = len(n_extra)
    off = np.zeros(n + 1, np.int64)
    for i in range(n):
        off[i + 1] = off[i] + (boff[i + 1] - boff[i]) * m + n_extra[i]
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
    request's `n_extra` unique pages, numbered from `base` in request order. Page ids are int32
    when they all fit (half the memory of the largest array: 1 GB at 240M references), else
    int64; the kernels take either."""
    refs = int((np.diff(boff) * m).sum() + n_extra.sum())
    top = int(blocks.max()) * m + m if len(blocks) else 0  # the block pages stay below this
    small = max(top, base + int(n_extra.sum())) < 2**31 - 1
    pages = np.empty(refs, np.int32 if small else np.int64)
    pages, off, nxt = _block_paths(blocks, boff, np.int64(m), n_extra, np.int64(base), pages)
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
