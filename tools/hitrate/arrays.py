"""A trace as compact numpy arrays: every request's page path, concatenated.

`PageArrays` is the `Layout.paged` view of a whole trace with no Python object per request:
`pages[offsets[i]:offsets[i + 1]]` are the ids of the full pages request `i` inserts (root first),
of which the first `n_lookup[i]` are those its lookup can hit, and `input_len[i]` caps its hit.
Page ids are dense integers below `num_pages`, so the analyses (`fast.py`) index flat arrays by
page id instead of hashing.

Block traces (`mooncake`, `lmcache`) are read as a stream (`BlockSink`): each parsed line's
block ids go straight into growing int64 buffers and the line's `Request` is dropped, so memory
is 8 bytes per block reference plus the reader's map of distinct hash ids. Token traces (`engine`,
`chat`, `completion`) go through `Layout.paged` (their pages are interned chains of real tokens).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tools.hitrate.pages import Layout
from tools.hitrate.traces import Request, Trace


@dataclass
class PageArrays:
    pages: np.ndarray  # page ids (int64; int32 from a block trace when they fit), root first
    offsets: np.ndarray  # int64, len requests + 1: request i is pages[offsets[i]:offsets[i+1]]
    n_lookup: np.ndarray  # int64, pages of request i its lookup can hit (a prefix of its path)
    input_len: np.ndarray  # int64, prompt tokens of request i (its hit is capped there)
    output_len: np.ndarray  # int64, generated tokens of request i (as the trace says)
    page_size: int  # tokens per page
    num_pages: int  # every page id is in [0, num_pages)

    @property
    def requests(self) -> int:
        return len(self.n_lookup)

    @property
    def input_tokens(self) -> int:
        return int(self.input_len.sum())

    def path(self, i: int) -> np.ndarray:
        return self.pages[self.offsets[i] : self.offsets[i + 1]]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.pages, self.offsets, self.n_lookup, self.input_len,
                                      self.output_len))


def from_trace(trace: Trace, page_size: int, *, ignore_output: bool = False) -> PageArrays:
    """The arrays of a trace already read into `Request`s (any format), via `Layout.paged`."""
    lay = Layout(trace, page_size, ignore_output=ignore_output)
    pages: array[int] = array("q")
    n = len(trace.requests)
    offsets = np.zeros(n + 1, np.int64)
    n_lookup = np.zeros(n, np.int64)
    input_len = np.zeros(n, np.int64)
    output_len = np.zeros(n, np.int64)
    for i, req in enumerate(trace.requests):
        pr = lay.paged(req)
        pages.extend(pr.pages)
        offsets[i + 1] = len(pages)
        n_lookup[i] = pr.n_lookup
        input_len[i] = pr.input_len
        output_len[i] = req.output_len
    arr = np.frombuffer(pages, np.int64).copy() if len(pages) else np.zeros(0, np.int64)
    return PageArrays(arr, offsets, n_lookup, input_len, output_len, page_size,
                      int(arr.max()) + 1 if len(arr) else 0)


def extend_ids(buf: array[int], ids: Sequence[int], big: dict[int, int]) -> None:
    """Append a request's hash ids to `buf` (int64). An id of 64 bits or more gets a stand-in
    below 0, the same one each time it comes back (`big` remembers them). `array.extend` keeps
    the ids it appended before the one that overflows: they are taken back first."""
    n = len(buf)
    try:
        buf.extend(ids)
    except OverflowError:
        del buf[n:]
        buf.extend(b if b < 1 << 63 else big.setdefault(b, -1 - len(big)) for b in ids)


class BlockSink:
    """Receives a block trace's requests one by one (`read_trace(..., sink=...)`) and keeps only
    their block ids and lengths in int64 buffers."""

    def __init__(self) -> None:
        self.blocks: array[int] = array("q")
        self._big: dict[int, int] = {}  # raw ids beyond int64 -> negative stand-ins
        self.n_blocks: array[int] = array("q")
        self.input_len: array[int] = array("q")
        self.output_len: array[int] = array("q")
        self.ts: array[float] = array("d")

    def __call__(self, req: Request) -> None:
        assert req.blocks is not None
        extend_ids(self.blocks, req.blocks, self._big)
        self.n_blocks.append(len(req.blocks))
        self.input_len.append(req.input_len)
        self.output_len.append(req.output_len)
        self.ts.append(req.ts)

    def add(self, blocks: Sequence[int], input_len: int, output_len: int, ts: float) -> None:
        """`self(req)` of a request's fields, without the `Request` (the reader's fast path)."""
        extend_ids(self.blocks, blocks, self._big)
        self.n_blocks.append(len(blocks))
        self.input_len.append(input_len)
        self.output_len.append(output_len)
        self.ts.append(ts)

    def add_many(self, blocks: np.ndarray, n_blocks: np.ndarray, input_len: np.ndarray,
                 output_len: np.ndarray, ts: np.ndarray) -> None:
        """`add` of many requests at once (the compiled scanner's arrays; ids below 2**63)."""
        self.blocks.frombytes(np.ascontiguousarray(blocks, np.int64).tobytes())
        self.n_blocks.frombytes(np.ascontiguousarray(n_blocks, np.int64).tobytes())
        self.input_len.frombytes(np.ascontiguousarray(input_len, np.int64).tobytes())
        self.output_len.frombytes(np.ascontiguousarray(output_len, np.int64).tobytes())
        self.ts.frombytes(np.ascontiguousarray(ts, np.float64).tobytes())

    def __len__(self) -> int:
        return len(self.n_blocks)

    def arrays(
        self, trace: Trace, page_size: int, *, ignore_output: bool = False
    ) -> PageArrays:
        """The page arrays, exactly as `from_trace` lays out the same requests: page `j` of block
        `b` is `b * (block_size // page_size) + j`; the `(1 + output_len) // page_size` pages of
        the unique tail token and the output come next on the path, numbered upwards from
        `(num_blocks + 1) * per_block` in request order. LMCache logs are put in timestamp order
        (stable), as `read_trace` does."""
        from tools.hitrate import layout_kernels

        Layout(trace, page_size)  # the same checks (page size divides the block size, ...)
        bs = trace.block_size or 0
        m = bs // page_size
        # numbered in place, in the sink's own buffer (no copy of the references)
        blocks = np.frombuffer(self.blocks, np.int64) if len(self.blocks) else np.zeros(0, np.int64)
        num_blocks = layout_kernels.dense_in_place(blocks)
        nb = _np(self.n_blocks, np.int64)
        inp = _np(self.input_len, np.int64)
        out = _np(self.output_len, np.int64)
        boff = np.zeros(len(nb) + 1, np.int64)
        np.cumsum(nb, out=boff[1:])
        if trace.format == "lmcache":
            order = np.argsort(_np(self.ts, np.float64), kind="stable")
            blocks, boff = layout_kernels.gather_segments(blocks, boff, order)
            inp, out = inp[order], out[order]
        n_extra = (1 + (np.zeros_like(out) if ignore_output else out)) // page_size
        base = (num_blocks + 1) * m
        pages, offsets, num_pages = layout_kernels.block_paths(blocks, boff, m, n_extra, base)
        del blocks
        self.blocks = array("q")
        return PageArrays(pages, offsets, np.diff(boff) * m, inp, out, page_size, num_pages)


def _np(buf: array, dtype: type) -> np.ndarray:
    return np.frombuffer(buf, dtype).copy() if len(buf) else np.zeros(0, dtype)
