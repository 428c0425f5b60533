"""`--sample RATE`: the LRU miss-ratio curve from a spatial sample of pages taken while a
Mooncake trace is read (SHARDS, Waldspurger et al., FAST '15), without the exact pass.

`SampleSink` receives the trace's requests one by one (`read_trace(..., sink=...)`) and keeps,
of each request's path, only the pages it samples:

- a page whose hash (SplitMix64 of the raw block id, then of the page's index in its block) falls
  in `rate` of the hash space stands for 1/rate pages, in the stack distances of the others and
  in its token gains; the unique tail and output pages are hashed by their rank the same way;
- a block looked up at least 1/rate times in the *validation slice* (the first `check_requests`
  requests) is kept whole, each of its pages standing for itself: in a prefix tree a few hot
  pages (a shared system prompt) carry much of the hit rate at small capacities, and hashing
  them away moves the whole curve there (`fast.sampled_stack` does the same over the whole
  trace; here only the slice has been counted when the rest streams by).

The slice's requests are also kept whole, so the run measures its own error: the exact
one-pass curve of the slice (`fast.stack_distances`) against the sampled curve of the same
requests (the same kept pages: a prefix of the sampled stream), at the capacities printed.
Memory: 12 bytes per request (lengths), the slice's block references and the sampled pages;
time: the reading, one pass over the sampled pages, one exact pass over the slice.

What it does not give: a request-level hit rate (a request's first page is sampled only at
`rate`), Belady's optimum, a replay through `HiRadixCache`, the reuse-distance histogram or
the sharing statistics: those need every page (the run without `--sample`).
"""

from __future__ import annotations

import argparse
import math
import time
from array import array
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit

from hicache_client.errors import ConfigError, HiCacheError
from tools.hitrate.arrays import BlockSink, extend_ids
from tools.hitrate.fast import fenwick_move
from tools.hitrate.traces import Request, Trace

_CHUNK = 1 << 20  # block references buffered before they are sampled (8 MiB)
_BITS = 24  # hash bits compared with the rate


def _start(n: int, warmup: float) -> int:
    """The first measured request of `n` (as `fast.warmup_start`)."""
    return int(math.floor(n * warmup))


def _cat_drop(pieces: list[np.ndarray]) -> np.ndarray:
    """The pieces concatenated; the list is emptied (each piece freed once copied)."""
    if not pieces:
        return np.zeros(0, np.int64)
    out = np.empty(sum(len(p) for p in pieces), pieces[0].dtype)
    k = 0
    while pieces:
        p = pieces.pop(0)
        out[k : k + len(p)] = p
        k += len(p)
    return out


@njit(cache=True)
def _gains(req, pos, nb, inp, m, ps):  # type: ignore[no-untyped-def]
    """Per kept reference (sorted by request, then path position): its token gain if it is a
    lookup page; per request with kept references: its index, offset and lookup count."""
    k = len(req)
    gain = np.zeros(k, np.float64)
    n_req = 0
    for i in range(k):
        if i == 0 or req[i] != req[i - 1]:
            n_req += 1
    kreq = np.empty(n_req, np.int64)
    koff = np.empty(n_req + 1, np.int64)
    klook = np.zeros(n_req, np.int64)
    r = -1
    for i in range(k):
        q = req[i]
        if i == 0 or q != req[i - 1]:
            r += 1
            kreq[r] = q
            koff[r] = i
        p = np.int64(pos[i])
        if p < np.int64(nb[q]) * m:
            L = inp[q]
            gain[i] = min(ps * (p + 1), L) - min(ps * p, L)
            klook[r] += 1
    koff[n_req] = k
    return gain, kreq, koff, klook


@njit(cache=True, inline="always")
def _mix1(z):  # type: ignore[no-untyped-def]
    """SplitMix64's finaliser of one uint64 (as `_mix`)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(cache=True)
def _scan(raw, nb, n_extra, lo, m, thr, hot, extra0, k_raw, k_j, k_req, k_pos, fill):  # type: ignore[no-untyped-def]
    """The kept references of consecutive requests (see `_sample_chunk`); written when `fill`,
    counted always."""
    mask = np.uint64((1 << _BITS) - 1)
    kk = np.uint64(0x5851F42D4C957F2D)
    nh = len(hot)
    cnt = 0
    i = 0
    x = extra0
    for r in range(len(nb)):
        for k in range(nb[r]):
            b = raw[i]
            i += 1
            is_hot = False
            if nh:
                at = np.searchsorted(hot, b)
                is_hot = at < nh and hot[at] == b
            hb = _mix1(np.uint64(b))
            for j in range(m):
                if is_hot or (_mix1(hb + np.uint64(j)) & mask) < thr:
                    if fill:
                        k_raw[cnt] = b
                        k_j[cnt] = j
                        k_req[cnt] = lo + r
                        k_pos[cnt] = k * m + j
                    cnt += 1
        for e in range(n_extra[r]):
            if (_mix1(x ^ kk) & mask) < thr:
                if fill:
                    k_raw[cnt] = np.int64(x)
                    k_j[cnt] = -1
                    k_req[cnt] = lo + r
                    k_pos[cnt] = nb[r] * m + e
                cnt += 1
            x += np.uint64(1)
    return cnt


def _sample_chunk(raw: np.ndarray, nb: np.ndarray, n_extra: np.ndarray, lo: np.int64,
                  m: np.int64, thr: np.uint64, hot: np.ndarray, extra0: np.uint64
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The kept references of consecutive requests (from `lo`; `nb[i]` blocks of `raw` each,
    then `n_extra[i]` unique pages ranked from `extra0`): page j of block b when b is hot (in
    the sorted `hot`) or when the low 24 bits of mix(mix(b) + j) fall under `thr`; a unique page
    of rank x when those of mix(x ^ K) do (mix: SplitMix64's finaliser). Returns raw id (the
    rank of a unique page), page index in the block (-1: unique), request, position on the
    path; in request, then path order."""
    args = (raw, nb, n_extra, lo, m, thr, hot, extra0)
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int16), np.zeros(0, np.int32),
             np.zeros(0, np.int32))
    cnt = _scan(*args, *empty, False)
    out = (np.empty(cnt, np.int64), np.empty(cnt, np.int16), np.empty(cnt, np.int32),
           np.empty(cnt, np.int32))
    _scan(*args, *out, True)
    return out


@njit(cache=True)
def _kept_stack(kpages, koff, klook, kgain, kreq, w, start):  # type: ignore[no-untyped-def]
    """Tree-order stack distances over the kept pages (request r: kpages[koff[r]:koff[r+1]],
    its first klook[r] looked up, path order; page p weighs w[p]): a kept lookup page's distance
    is 1 + the weight of the kept pages touched since it was. Returns, per re-used lookup page
    of a measured request (kreq >= start), its distance and its weighted token gain."""
    n = len(klook)
    total = koff[n]
    tree = np.zeros(total + 2, np.float64)
    last = np.full(len(w), -1, np.int64)
    dist = np.empty(total, np.int64)
    gain = np.empty(total, np.float64)
    k = 0
    size = total + 1
    live = 0.0
    clock = 0
    for r in range(n):
        o = koff[r]
        e = koff[r + 1]
        if kreq[r] >= start:
            for i in range(klook[r]):
                p = kpages[o + i]
                t = last[p]
                if t < 0:
                    break  # the deeper pages of a chained path are cold too
                sm = 0.0
                j = t + 1
                while j > 0:
                    sm += tree[j]
                    j -= j & -j
                dist[k] = int(math.ceil(1.0 + live - sm - 1e-9))
                gain[k] = kgain[o + i] * w[p]
                k += 1
        for q in range(e - o):  # deepest first, as the tree inserts a path
            p = kpages[e - 1 - q]
            if last[p] < 0:
                live += w[p]
            fenwick_move(tree, size, last[p], clock, w[p])
            last[p] = clock
            clock += 1
    return dist[:k], gain[:k]


@dataclass
class SampledCurve:
    """A token hit curve from sampled distances: hit_tokens(c) sums the gains at distance <= c."""

    input_tokens: int
    dist: np.ndarray  # sorted distances (pages) of the re-used sampled lookup pages
    cum: np.ndarray  # cumulative weighted token gains along `dist`

    @classmethod
    def of(cls, input_tokens: int, dist: np.ndarray, gain: np.ndarray) -> SampledCurve:
        order = np.argsort(dist, kind="stable")
        return cls(input_tokens, dist[order], np.cumsum(gain[order]))

    def hit_tokens(self, capacity_pages: float) -> float:
        if capacity_pages < 1 or not len(self.dist):
            return 0.0
        if math.isinf(capacity_pages):
            return float(self.cum[-1])
        i = int(np.searchsorted(self.dist, capacity_pages, side="right"))
        return float(self.cum[i - 1]) if i else 0.0

    def hit_rate(self, capacity_pages: float) -> float:
        return self.hit_tokens(capacity_pages) / self.input_tokens if self.input_tokens else 0.0

    @property
    def saturation_pages(self) -> int:
        return int(self.dist[-1]) if len(self.dist) else 0

    def capacity_for(self, hit_rate: float) -> int | None:
        need = hit_rate * self.input_tokens
        if need <= 0:
            return 0
        i = int(np.searchsorted(self.cum, need - 1e-9, side="left"))
        return None if i >= len(self.cum) else int(self.dist[i])


@dataclass
class ExactCurve:
    """The exact one-pass token hit curve of the validation slice (`fast.stack_distances`)."""

    input_tokens: int
    cum_tok: np.ndarray  # distance (pages) -> tokens hit at that capacity

    def hit_tokens(self, capacity_pages: float) -> int:
        if capacity_pages < 0 or not len(self.cum_tok):
            return 0
        c = len(self.cum_tok) - 1
        if not math.isinf(capacity_pages):
            c = min(int(capacity_pages), c)
        return int(self.cum_tok[c])


@dataclass
class Sample:
    """What a sampled read gives: the curve, its slice check and the counts to state."""

    rate: float
    curve: SampledCurve  # the whole trace's sampled curve
    requests: int  # measured requests (after the warm-up)
    page_refs: int  # every page reference of the trace (counted, not kept)
    sampled_refs: int  # page references kept (sampled or hot)
    hot_blocks: int  # blocks kept whole (looked up >= 1/rate times in the slice)
    hot_refs: int  # page references of the hot blocks' pages (in sampled_refs)
    check_requests: int  # requests of the validation slice (0: none)
    check_exact: ExactCurve | None  # the slice's exact curve
    check_sampled: SampledCurve | None  # the sampled curve of the slice's requests


class SampleSink:
    """Receives a Mooncake trace's requests (`read_trace(..., sink=...)`, raw hash ids) and keeps
    the sampled page references (see the module docstring); `finish` computes the curves."""

    def __init__(self, rate: float, block_size: int, page_size: int, *,
                 ignore_output: bool = False, check_requests: int = 1_000_000,
                 warmup: float = 0.0) -> None:
        if not 0.0 < rate <= 1.0:
            raise ConfigError(f"--sample must be a rate in (0, 1], got {rate}")
        if page_size < 1 or block_size % page_size:
            raise ConfigError(f"page size {page_size} must divide the block size {block_size}")
        self.rate = rate
        self.ps = page_size
        self.m = block_size // page_size
        self.ignore_output = ignore_output
        self.check_requests = max(0, check_requests)
        self.warmup = warmup
        self.threshold = max(1, round(rate * (1 << _BITS)))
        self._big: dict[int, int] = {}  # raw ids beyond int64 -> negative stand-ins
        self._buf: array[int] = array("q")  # raw block ids not yet sampled
        # per request: blocks, input tokens, output tokens (int32: --max-request-tokens < 2**31)
        self._lens: array[int] = array("i")
        self._n = 0  # requests received
        self._done = 0  # requests whose blocks were sampled
        self._extra = 0  # unique pages numbered so far
        # sorted raw ids of the hot blocks; None until the slice is read
        self._hot: np.ndarray | None = None if self.check_requests else np.zeros(0, np.int64)
        self._slice_n = 0  # requests of the slice
        self._check: ExactCurve | None = None
        # kept references, per chunk, in request then path order: raw block id (the unique
        # pages' rank), page index in its block (-1: a unique page), request, position on path
        self._kept: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []

    def __call__(self, req: Request) -> None:
        assert req.blocks is not None
        extend_ids(self._buf, req.blocks, self._big)
        try:
            self._lens.extend((len(req.blocks), req.input_len, req.output_len))
        except OverflowError:
            raise ConfigError("--sample takes requests of fewer than 2**31 tokens") from None
        self._n += 1
        if self._hot is None:
            if self._n == self.check_requests:
                self._end_slice()
        elif len(self._buf) >= _CHUNK:
            self._flush()

    def __len__(self) -> int:
        return self._n

    def _lengths(self, lo: int, hi: int) -> np.ndarray:
        """(blocks, input, output) of requests lo:hi, a copy."""
        return np.frombuffer(self._lens, np.int32)[3 * lo : 3 * hi].reshape(-1, 3).astype(np.int64)

    def _end_slice(self) -> None:
        """The slice is read: its hot blocks (looked up >= 1/rate times) are fixed, its
        references sampled, and its exact curve computed from the same buffer, then dropped."""
        from tools.hitrate import fast

        raw = np.frombuffer(self._buf, np.int64) if len(self._buf) else np.zeros(0, np.int64)
        ids, counts = np.unique(raw, return_counts=True)
        self._hot = ids[counts >= 1.0 / self.rate]
        del ids, counts, raw
        self._slice_n = self._n
        self._flush(keep_buffer=True)
        lens = self._lengths(0, self._n)
        sink = BlockSink()  # the buffer's ids are renumbered in place: it is not read again
        sink.blocks, self._buf = self._buf, array("q")
        for col, buf in enumerate((sink.n_blocks, sink.input_len, sink.output_len)):
            buf.frombytes(np.ascontiguousarray(lens[:, col]).tobytes())
        trace = Trace(path="", format="mooncake", requests=[], block_size=self.m * self.ps)
        arrs = sink.arrays(trace, self.ps, ignore_output=self.ignore_output)
        del sink
        st = fast.stack_distances(arrs, warmup=self.warmup)
        self._check = ExactCurve(st.input_tokens, st.cum_tok)

    def _flush(self, keep_buffer: bool = False) -> None:
        if self._hot is None:
            self._end_slice()
            return
        lo, hi = self._done, self._n
        if hi == lo:
            return
        raw = np.frombuffer(self._buf, np.int64) if len(self._buf) else np.zeros(0, np.int64)
        if not keep_buffer:
            self._buf = array("q")  # the view keeps the old buffer until the chunk is done
        lens = self._lengths(lo, hi)
        # in pieces of about _CHUNK references (the slice is one long buffer): the temporaries
        # of a piece are a few times its size
        ends = np.cumsum(lens[:, 0])
        a = 0
        while a < hi - lo:
            b = max(a + 1, int(np.searchsorted(ends, (ends[a - 1] if a else 0) + _CHUNK)))
            r0 = int(ends[a - 1]) if a else 0
            self._sample(raw[r0 : int(ends[b - 1])], lo + a, lens[a:b])
            a = b
        self._done = hi

    def _sample(self, raw: np.ndarray, lo: int, lens: np.ndarray) -> None:
        """Keeps the sampled references of requests lo, lo+1, ... (their lengths `lens`, their
        blocks `raw`), in request then path order."""
        hot = self._hot
        assert hot is not None
        out = np.zeros(len(lens), np.int64) if self.ignore_output else lens[:, 2]
        n_extra = (1 + out) // self.ps  # the unique tail and output pages, by rank
        k_raw, k_j, k_req, k_pos = _sample_chunk(
            raw, np.ascontiguousarray(lens[:, 0]), n_extra, np.int64(lo), np.int64(self.m),
            np.uint64(self.threshold), hot, np.uint64(self._extra))
        self._extra += int(n_extra.sum())
        if len(k_raw):
            self._kept.append((k_raw, k_j, k_req, k_pos))

    def finish(self) -> Sample:
        """The sampled curve of the whole trace and its check on the slice."""
        if self._hot is None:  # the trace is shorter than the slice: the slice is all of it
            self._end_slice()
        self._flush()
        n = self._n
        # one field at a time, each chunk's piece dropped once copied
        fields = [list(x) for x in zip(*self._kept)] if self._kept else [[] for _ in range(4)]
        self._kept = []
        raw, jj, req, pos = (_cat_drop(f) for f in fields)
        # dense page ids: blocks' pages by (raw id, page index), unique pages after them
        blk = jj >= 0
        uniq, inv = np.unique(raw[blk], return_inverse=True)
        n_unique = len(raw) - int(blk.sum())
        page = np.empty(len(raw), np.int64)
        page[blk] = inv * self.m + jj[blk]
        base = len(uniq) * self.m
        page[~blk] = base + np.arange(n_unique, dtype=np.int64)
        del inv, raw, jj, blk
        assert self._hot is not None
        hot = np.zeros(base + n_unique, np.bool_)
        if len(self._hot):
            hot[:base] = np.repeat(np.isin(uniq, self._hot), self.m)
        w = np.where(hot, 1.0, 1.0 / self.rate)
        hot_refs = int(np.count_nonzero(hot[page]))
        del hot, uniq
        lens = np.frombuffer(self._lens, np.int32).reshape(-1, 3) if n else np.zeros(
            (0, 3), np.int32)
        nb = np.ascontiguousarray(lens[:, 0])
        inp = np.ascontiguousarray(lens[:, 1]).astype(np.int64)
        del lens
        self._lens = array("i")
        gain, kreq, koff, klook = _gains(req, pos, nb, inp, np.int64(self.m),
                                         np.int64(self.ps))
        del req, pos

        def curve(upto: int) -> SampledCurve:
            r = int(np.searchsorted(kreq, upto, side="left"))
            s0 = _start(upto, self.warmup)
            d, g = _kept_stack(page, koff[: r + 1], klook[:r], gain, kreq[:r], w, np.int64(s0))
            return SampledCurve.of(int(inp[s0:upto].sum()), d, g)

        return Sample(
            rate=self.rate, curve=curve(n), requests=n - _start(n, self.warmup),
            page_refs=int(nb.sum(dtype=np.int64)) * self.m + self._extra,
            sampled_refs=len(page), hot_blocks=len(self._hot), hot_refs=hot_refs,
            check_requests=self._slice_n if self._check else 0,
            check_exact=self._check,
            check_sampled=curve(self._slice_n) if self._check is not None else None,
        )


def read_sampled(args: argparse.Namespace, trace_fmt: str
                 ) -> tuple[Trace, SampleSink, list[str]]:
    """Reads TRACE (a Mooncake trace) through a `SampleSink` at `args.sample`."""
    from tools.hitrate.trace_dir import read_path
    from tools.hitrate.traces import Limits

    page_size = args.page_size or args.block_size
    check = args.sample_check
    sink = SampleSink(args.sample, args.block_size, page_size, ignore_output=args.ignore_output,
                      check_requests=(1 << 62) if check == "all" else int(check),
                      warmup=args.warmup)
    trace, notes = read_path(
        args.trace, trace_fmt, block_size=args.block_size, skip_bad_lines=args.skip_bad_lines,
        limit=args.limit, limits=Limits(args.max_request_tokens, args.max_line_bytes), sink=sink,
        progress=False if args.no_progress else None,
    )
    if not trace.count:
        raise HiCacheError(f"{args.trace}: no requests")
    return trace, sink, notes


def sampled_report(args: argparse.Namespace, kvb: float | None) -> dict[str, Any]:
    """The JSON document of `hicache-hitrate --sample RATE`: the sampled LRU curve at the
    printed capacities and the error measured on the validation slice (or, for a trace that is
    not a Mooncake trace, against the exact curve of the whole trace, which is then read into
    arrays anyway). Keys the sampled run does not compute are None."""
    from tools.hitrate import fast, mrc
    from tools.hitrate.inputs import read_arrays
    from tools.hitrate.report import SCHEMA
    from tools.hitrate.trace_dir import read_path
    from tools.hitrate.traces import Limits

    t0 = time.perf_counter()
    streamed = False
    fmt = args.format
    if not args.tokenizer and args.replay_mode == "pages":  # a token trace needs no peek
        fmt = read_path(args.trace, args.format, block_size=args.block_size, limit=1,
                        skip_bad_lines=args.skip_bad_lines,
                        limits=Limits(args.max_request_tokens, args.max_line_bytes),
                        sink=lambda r: None, progress=False)[0].format
        streamed = fmt == "mooncake"
    notes: list[str] = []
    exact: Any = None
    if streamed:
        trace, sink, notes = read_sampled(args, fmt)
        t_read = time.perf_counter() - t0
        t0 = time.perf_counter()
        smp = sink.finish()
        del sink
        curve: Any = smp.curve
        page_size, n_req = args.page_size or args.block_size, smp.requests
        sampled_refs, page_refs, hot, n_all = (smp.sampled_refs, smp.page_refs, smp.hot_blocks,
                                               len(trace.requests) or trace.count)
        check_n, check_exact, check_curve = smp.check_requests, smp.check_exact, smp.check_sampled
    else:  # a token trace or an LMCache log: read whole, sampled from its arrays
        trace, arrs, notes, _, t_read = read_arrays(args)
        t0 = time.perf_counter()
        page_size, n_req = arrs.page_size, arrs.requests - fast.warmup_start(arrs, args.warmup)
        curve = fast.sampled_stack(arrs, args.sample)
        sampled_refs, page_refs, n_all = curve.sampled_refs, len(arrs.pages), arrs.requests
        hot = None
        exact = fast.stack_distances(arrs, warmup=args.warmup)
        check_n, check_exact, check_curve = arrs.requests, exact, curve
        notes.append(f"a {trace.format} trace is read whole: the sampled curve is measured "
                     "against the exact curve of the whole trace")
    n_in = curve.input_tokens

    def cap_bytes(p: int | None) -> float | None:
        return None if p is None or kvb is None else p * page_size * kvb

    points = []
    errs = []
    for c in mrc.mrc_points(curve, args.mrc_points):
        rate = curve.hit_tokens(c) / n_in if n_in else 0.0
        pt: dict[str, Any] = {"capacity_pages": c, "capacity_tokens": c * page_size,
                              "capacity_bytes": cap_bytes(c), "hit_rate": rate,
                              "miss_ratio": 1 - rate, "request_hit_rate": None}
        if check_exact is not None and check_curve is not None:
            ci = check_exact.input_tokens or 1
            pt["check_exact_hit_rate"] = check_exact.hit_tokens(c) / ci
            pt["check_sampled_hit_rate"] = check_curve.hit_tokens(c) / ci
            errs.append(abs(pt["check_exact_hit_rate"] - pt["check_sampled_hit_rate"]))
        points.append(pt)
    target_doc = None
    if args.target is not None:
        tc = curve.capacity_for(args.target)
        target_doc = {"hit_rate": args.target, "capacity_pages": tc,
                      "capacity_tokens": None if tc is None else tc * page_size,
                      "capacity_bytes": cap_bytes(tc), "relative": None}
    sample_doc = {
        "rate": args.sample,
        "streamed": streamed,
        "sampled_page_refs": sampled_refs,
        "page_refs": page_refs,
        "hot_blocks": hot,
        "check": None if not errs else {
            "requests": check_n,
            "of_requests": n_all,
            "whole_trace": check_n >= n_all,
            "max_abs_error": max(errs),
            "mean_abs_error": sum(errs) / len(errs),
        },
    }
    t_an = time.perf_counter() - t0
    return {
        "schema": SCHEMA,
        "trace": {
            "path": trace.path, "format": trace.format, "requests": n_req, "input_tokens": n_in,
            "output_tokens": None, "block_size": trace.block_size, "bad_lines": trace.bad_lines,
            "bad_line_numbers": trace.bad_line_numbers,
        },
        "config": {"page_size": page_size, "kv_bytes_per_token": kvb,
                   "model": args.model or args.model_path, "kv_dtype": args.kv_dtype,
                   "tp": args.tp, "ignore_output": args.ignore_output, "warmup": args.warmup},
        "result": None, "unbounded": None, "opt": None, "savings": None,
        "reuse_distance": None, "sharing": None, "sweep": None, "engine": None,
        "mrc": {"model": "lru, device only, sampled", "points": points, "target": target_doc,
                "saturation_pages": curve.saturation_pages, "sample": sample_doc},
        "timing": {"read_s": t_read, "simulate_s": 0.0, "analysis_s": t_an,
                   "requests_per_s": None},
        "notes": notes,
    }
