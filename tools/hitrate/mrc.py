"""One-pass analyses over page paths: LRU stack distances (miss-ratio curve, reuse distances),
Belady's offline optimum, the unbounded bound and prefix-sharing statistics.

All of them use the accounting of `simulate.py`: a request hits the leading pages of its lookup
that are cached, and its hit tokens are `min(page_size * k, input_len)`.

Stack distances. A cache that evicts the least recently used *leaf* of a prefix tree, where a
request refreshes every page on its path, behaves as an LRU stack over pages in which a request's
pages are pushed deepest first (so a parent is always more recent than its children): a page is
cached at capacity C (pages) exactly when fewer than C distinct pages were touched since it was
last touched, counting, within one request, its ancestors as more recent. The set held at any C is
then prefix-closed, distances grow strictly along a request's path, and the request hits
`#{i : d_i <= C}` pages. One pass gives every capacity at once (Mattson et al., 1970). `order=
"flat"` pushes pages root first instead, as a flat LRU of chunks does (LMCache's simulator): the
root is then the least recent, and a request hits its leading run of pages with `d_i <= C`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tools.hitrate.pages import PagedRequest

INF = math.inf


class _Fenwick:
    """Counts of live timestamps; `suffix(t)` = live timestamps > t."""

    __slots__ = ("n", "tree", "live")

    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = [0] * (n + 1)
        self.live = 0

    def add(self, i: int, v: int) -> None:
        tree, n = self.tree, self.n
        self.live += v
        i += 1
        while i <= n:
            tree[i] += v
            i += i & -i

    def suffix(self, i: int) -> int:
        """Live timestamps strictly greater than i."""
        tree = self.tree
        s = 0
        i += 1
        while i > 0:
            s += tree[i]
            i -= i & -i
        return self.live - s


@dataclass
class StackResult:
    """Distances of one pass. Token and request weights are keyed by stack distance (pages)."""

    page_size: int
    input_tokens: int
    requests: int
    hit_tokens_at: dict[int, int] = field(default_factory=dict)  # distance -> tokens gained
    hit_requests_at: dict[int, int] = field(default_factory=dict)  # distance -> requests gained
    reuse_pages_at: dict[int, int] = field(default_factory=dict)  # distance -> pages hit
    cold_pages: int = 0  # lookup pages never seen before
    max_pages: int = 0  # the most distinct pages ever live (unbounded cache size)
    # keep_distances=True: per request, the stack distance of each cached lookup page.
    distances: list[list[int]] | None = None

    def curve(self) -> tuple[list[int], list[int], list[int]]:
        """(distances ascending, cumulative hit tokens, cumulative hit requests)."""
        ds = sorted(set(self.hit_tokens_at) | set(self.hit_requests_at))
        tok, req, ct, cr = [], [], 0, 0
        for d in ds:
            ct += self.hit_tokens_at.get(d, 0)
            cr += self.hit_requests_at.get(d, 0)
            tok.append(ct)
            req.append(cr)
        return ds, tok, req

    def hit_tokens(self, capacity_pages: float) -> int:
        return sum(w for d, w in self.hit_tokens_at.items() if d <= capacity_pages)

    def hit_requests(self, capacity_pages: float) -> int:
        return sum(w for d, w in self.hit_requests_at.items() if d <= capacity_pages)

    @property
    def unbounded_hit_tokens(self) -> int:
        return sum(self.hit_tokens_at.values())

    @property
    def unbounded_hit_requests(self) -> int:
        return sum(self.hit_requests_at.values())

    @property
    def saturation_pages(self) -> int:
        """The largest stack distance that brings a hit (0: none)."""
        return max(self.hit_tokens_at, default=0)

    def reuse_buckets(self) -> list[dict[str, int]]:
        return reuse_histogram(self)

    def capacity_for(self, hit_rate: float) -> int | None:
        """Smallest capacity in pages whose token hit rate is >= hit_rate (None: unreachable)."""
        need = hit_rate * self.input_tokens
        if need <= 0:
            return 0
        ds, tok, _ = self.curve()
        for d, t in zip(ds, tok):
            if t >= need - 1e-9:
                return d
        return None


def stack_distances(
    reqs: Iterable[PagedRequest],
    page_size: int,
    *,
    order: str = "tree",
    total_pages: int = 0,
    keep_distances: bool = False,
) -> StackResult:
    """One pass of LRU stack distances over page paths (see the module docstring)."""
    if order not in ("tree", "flat"):
        raise ValueError(f"order must be 'tree' or 'flat', got {order!r}")
    reqs = list(reqs)
    n_touch = total_pages or sum(len(r.pages) if order == "tree" else r.n_lookup for r in reqs)
    fw = _Fenwick(n_touch + 1)
    last: dict[int, int] = {}
    clock = 0
    res = StackResult(page_size, sum(r.input_len for r in reqs), len(reqs))
    tok_at, req_at, reuse_at = res.hit_tokens_at, res.hit_requests_at, res.reuse_pages_at
    ps = page_size
    if keep_distances:
        res.distances = []
    for r in reqs:
        pages, L = r.pages, r.input_len
        running = 0
        prev_tokens = 0
        ds: list[int] = []
        if res.distances is not None:
            res.distances.append(ds)
        for i in range(r.n_lookup):
            t = last.get(pages[i])
            if t is None:
                res.cold_pages += r.n_lookup - i
                break
            d = fw.suffix(t) + 1
            ds.append(d)
            reuse_at[d] = reuse_at.get(d, 0) + 1
            if order == "flat":
                running = d if d > running else running
                d = running
            tokens = min(ps * (i + 1), L)
            gain = tokens - prev_tokens
            prev_tokens = tokens
            if gain:
                tok_at[d] = tok_at.get(d, 0) + gain
            if i == 0:
                req_at[d] = req_at.get(d, 0) + 1
        touched = pages if order == "tree" else pages[: r.n_lookup]
        seq = reversed(touched) if order == "tree" else touched
        for p in seq:
            t = last.get(p)
            if t is not None:
                fw.add(t, -1)
            fw.add(clock, 1)
            last[p] = clock
            clock += 1
        if fw.live > res.max_pages:
            res.max_pages = fw.live
    return res


def mrc_points(res: Any, n_points: int) -> list[int]:
    """`n_points` distinct capacities (pages), log-spaced from 1 page to the saturation point
    (the largest stack distance that brings a hit); fewer when there are fewer integers.
    `res`: a `StackResult` or a `fast.ArrayStack`."""
    top = max(res.saturation_pages, 1)
    if n_points <= 1 or top == 1:
        return [top]
    if n_points >= top:
        return list(range(1, top + 1))
    k = n_points
    pts: list[int] = []
    while len(pts) < n_points:
        pts = sorted({max(1, round(top ** (i / (k - 1)))) for i in range(k)})
        k += 1
    return [*pts[: n_points - 1], top]


def unbounded(reqs: Sequence[PagedRequest], page_size: int) -> tuple[int, int]:
    """(hit tokens, hit requests) with unbounded capacity: leading pages seen before."""
    seen: set[int] = set()
    tokens = hits = 0
    for r in reqs:
        k = 0
        for i in range(r.n_lookup):
            if r.pages[i] in seen:
                k += 1
            else:
                break
        if k:
            tokens += min(page_size * k, r.input_len)
            hits += 1
        seen.update(r.pages)
    return tokens, hits


@dataclass
class OptResult:
    capacity_pages: int
    hit_tokens: int
    hit_requests: int
    hit_pages: int


def belady(reqs: Sequence[PagedRequest], page_size: int, capacity_pages: int) -> OptResult:
    """Belady's MIN over pages, prefix-aware (see docs/hitrate.md).

    After each request, while more than `capacity_pages` pages are cached, evict the page whose
    next use (the next request whose *lookup* covers it) is farthest; ties go to the deepest page.
    A page's next use is never earlier than its parent's (every request that uses a page uses its
    whole prefix), so the cached set stays prefix-closed and a request hits every cached page of
    its lookup path.
    """
    n = len(reqs)
    # next_use[r][i]: next request after r whose lookup covers reqs[r].pages[i] (n = never).
    nxt: dict[int, int] = {}
    next_use: list[list[int]] = [[]] * n
    for ri in range(n - 1, -1, -1):
        r = reqs[ri]
        next_use[ri] = [nxt.get(p, n) for p in r.pages]
        for i in range(r.n_lookup):
            nxt[r.pages[i]] = ri
    cached: dict[int, tuple[int, int]] = {}  # page -> (next use, depth)
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, page), lazily invalidated
    hit_tokens = hit_requests = hit_pages = 0
    for ri, r in enumerate(reqs):
        pages = r.pages
        k = 0
        while k < r.n_lookup and pages[k] in cached:
            k += 1
        if k:
            hit_pages += k
            hit_tokens += min(page_size * k, r.input_len)
            hit_requests += 1
        nu = next_use[ri]
        for depth, p in enumerate(pages):
            entry = (nu[depth], depth)
            if cached.get(p) != entry:
                cached[p] = entry
                heapq.heappush(heap, (-entry[0], -depth, p))
        while len(cached) > capacity_pages:
            neg_nu, neg_depth, p = heapq.heappop(heap)
            if cached.get(p) == (-neg_nu, -neg_depth):
                del cached[p]
    return OptResult(capacity_pages, hit_tokens, hit_requests, hit_pages)


@dataclass
class Sharing:
    unique_pages: int  # distinct pages over all lookups
    lookup_page_refs: int  # pages looked up in total
    shared_prefix_tokens: int  # input tokens in a leading run shared with any other request
    shared_prefix_ratio: float
    requests_with_shared_prefix: int
    distinct_first_pages: int  # distinct roots (first pages) among lookups
    shared_fraction_p50: float  # per-request shared-prefix fraction of the input
    shared_fraction_p90: float


def sharing(reqs: Sequence[PagedRequest], page_size: int) -> Sharing:
    """How much of each input is a prefix it shares with some other request (past or future)."""
    users: dict[int, int] = {}
    firsts: set[int] = set()
    refs = 0
    for r in reqs:
        refs += r.n_lookup
        if r.n_lookup:
            firsts.add(r.pages[0])
        for i in range(r.n_lookup):
            p = r.pages[i]
            users[p] = users.get(p, 0) + 1
    total_in = sum(r.input_len for r in reqs)
    shared = n_shared = 0
    fracs = []
    for r in reqs:
        k = 0
        while k < r.n_lookup and users[r.pages[k]] > 1:
            k += 1
        t = min(page_size * k, r.input_len)
        shared += t
        n_shared += 1 if k else 0
        fracs.append(t / r.input_len if r.input_len else 0.0)
    fracs.sort()

    def pct(q: float) -> float:
        if not fracs:
            return 0.0
        return fracs[min(len(fracs) - 1, max(0, math.ceil(q * len(fracs)) - 1))]

    return Sharing(
        unique_pages=len(users),
        lookup_page_refs=refs,
        shared_prefix_tokens=shared,
        shared_prefix_ratio=shared / total_in if total_in else 0.0,
        requests_with_shared_prefix=n_shared,
        distinct_first_pages=len(firsts),
        shared_fraction_p50=pct(0.5),
        shared_fraction_p90=pct(0.9),
    )


def reuse_histogram(res: StackResult) -> list[dict[str, int]]:
    """Stack distances of re-used lookup pages in power-of-two buckets [lo, hi] (pages)."""
    buckets: dict[int, int] = {}
    for d, c in res.reuse_pages_at.items():
        b = d.bit_length() - 1
        buckets[b] = buckets.get(b, 0) + c
    out = []
    for b in sorted(buckets):
        out.append({"min_pages": 1 << b, "max_pages": (1 << (b + 1)) - 1, "pages": buckets[b]})
    return out
