"""Replays a trace through the real `HiRadixCache` in simulated mode.

Each request goes through `hicache.simulation.simulate_request` (prefetch, acquire, allocate,
insert, release: the engine's lifecycle), one at a time, in trace order. A request's hit is the
leading cached tokens the cache reports, capped at its input length; when the cap bites (a
Mooncake request's partial last block) the excess is taken off the deepest tier first (storage,
then host, then device).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache.config import DEFAULT_PREFETCH_THRESHOLD, HiCacheConfig
from hicache_client.errors import ConfigError
from tools.hitrate.arrays import PageArrays
from tools.hitrate.pages import Layout
from tools.hitrate.traces import Trace

logger = logging.getLogger(__name__)


@dataclass
class TierConfig:
    """Capacities in pages. `None` = unbounded; 0 = the tier is absent."""

    page_size: int
    device_pages: int | None
    host_pages: int = 0
    storage_pages: int | None = 0
    write_policy: str = "write_through"
    eviction_policy: str = "lru"
    eviction_config: Mapping[str, Any] = field(default_factory=dict)
    prefetch_policy: str = "best_effort"
    prefetch_threshold: int | None = None  # None: HiCacheConfig's default
    load_back_threshold: int | None = None
    storage_admission: str = "always"  # hicache.admission: always, reuse:N, frequency[:H]

    def total_pages(self) -> float:
        """Distinct pages the tiers can hold together (inf when one is unbounded)."""
        parts = [self.device_pages, self.host_pages, self.storage_pages]
        if any(p is None for p in parts):
            return float("inf")
        return float(sum(p for p in parts if p))


@dataclass
class SimResult:
    requests: int = 0
    input_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    hit_requests: int = 0
    capped_tokens: int = 0  # cache hits beyond the input length (Mooncake partial blocks)
    per_request_hits: list[int] = field(default_factory=list)
    engine_cached_tokens: int | None = None  # engine traces: the engine's own counter
    engine_mismatched_requests: int = 0
    # Engine traces: prompt tokens by outcome (hicache.attribution), the engine's (summed from
    # the log's cache_outcomes) and the replay's (--replay-mode tokens only; None otherwise).
    engine_outcomes: dict[str, int] | None = None
    predicted_outcomes: dict[str, int] | None = None
    cache_stats: dict[str, float] = field(default_factory=dict)
    device_pages: int = 0  # the capacities actually used (unbounded resolved)
    host_pages: int = 0
    storage_pages: int | None = 0

    @property
    def hit_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens


def build_cache(tiers: TierConfig, unbounded_pages: int, *, page_ids: bool = False) -> Any:
    """A simulated `HiRadixCache`; unbounded tiers get `unbounded_pages` pages.

    `page_ids`: the cache runs at page size 1 over page ids (one "token" per page), with the
    token thresholds turned into page counts, so it makes the same decisions as a cache of
    `tiers.page_size` over the tokens (see `replay`)."""
    from hicache.hiradix import HiRadixCache
    from hicache.simulation import SimStorage

    ps = tiers.page_size
    kwargs: dict[str, Any] = dict(
        page_size=1 if page_ids else ps,
        write_policy=tiers.write_policy,
        eviction_policy=tiers.eviction_policy,
        eviction_config=dict(tiers.eviction_config),
        prefetch_policy=tiers.prefetch_policy,
        storage_admission=tiers.storage_admission,
        simulated=True,
        synchronous=True,
    )
    defaults = HiCacheConfig()
    prefetch = tiers.prefetch_threshold
    load_back = tiers.load_back_threshold
    prefetch = DEFAULT_PREFETCH_THRESHOLD if prefetch is None else prefetch  # (no cost model)
    load_back = defaults.load_back_threshold if load_back is None else load_back
    if page_ids:
        # "at least T tokens" over whole pages is "at least ceil(T / page_size) pages".
        prefetch, load_back = -(-prefetch // ps), -(-load_back // ps)
    kwargs["prefetch_threshold"] = prefetch
    kwargs["load_back_threshold"] = load_back
    device = tiers.device_pages if tiers.device_pages is not None else unbounded_pages
    host = tiers.host_pages if tiers.host_pages is not None else unbounded_pages
    storage = None
    if tiers.storage_pages is None or tiers.storage_pages > 0:
        if not host:  # no L2 cache: host memory only stages pages to and from L3
            kwargs["host_memory_mode"] = "buffer_only"
            host = 2 * device
        storage = SimStorage(capacity_pages=tiers.storage_pages)
    config = HiCacheConfig(**kwargs)
    if device < 1:
        raise ConfigError("the device tier needs at least one page")
    return HiRadixCache(config, num_device_pages=device, num_host_pages=host, sim_storage=storage)


def _progress(total: int, enabled: bool | None, desc: str) -> Any:
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, mininterval=0.5)


def replay(
    trace: Trace,
    tiers: TierConfig,
    *,
    ignore_output: bool = False,
    progress: bool | None = False,
    mode: str = "pages",
) -> SimResult:
    """Replays every request of `trace` through a fresh simulated cache.

    `mode="tokens"` hands the cache the requests' token lists at `tiers.page_size`.
    `mode="pages"` (the default, much faster for large pages) hands it page ids at page size 1:
    every full page becomes one id that names the page's content *and* its prefix (the
    `Layout.paged` view), the lookup is the pages of `prompt[:-1]`, the insert the pages of
    `prompt + output`, and token thresholds become page counts. The tree then has the same
    shape, the policies see the same nodes in the same order, and the per-tier hits are the
    same page for page; a test replays random traces both ways and asserts equal counters.
    """
    from hicache.simulation import replay_request, simulate_request

    if mode not in ("pages", "tokens"):
        raise ValueError(f"mode must be 'pages' or 'tokens', got {mode!r}")
    page_ids = mode == "pages"
    ps = tiers.page_size

    layout = Layout(trace, tiers.page_size, ignore_output=ignore_output)
    reqs = trace.requests
    # Enough pages for everything the trace could ever insert (an unbounded tier).
    unbounded = 2
    for r in reqs:
        n_out = 0 if ignore_output else r.output_len
        n_in = len(r.blocks) * (trace.block_size or 0) + 1 if r.blocks is not None else r.input_len
        unbounded += (n_in + n_out) // tiers.page_size + 1
    cache = build_cache(tiers, unbounded, page_ids=page_ids)
    res = SimResult(
        device_pages=tiers.device_pages if tiers.device_pages is not None else unbounded,
        host_pages=tiers.host_pages if tiers.host_pages is not None else unbounded,
        storage_pages=tiers.storage_pages,
    )
    engine_total = 0
    bar = _progress(len(reqs), progress, "replaying")
    try:
        for i, req in enumerate(reqs):
            rid = req.rid or str(i)
            if page_ids:
                pr = layout.paged(req)
                sr = replay_request(cache, rid, pr.pages[: pr.n_lookup], pr.pages,
                                    req.extra_key, req.input_len)
                dev, host, sto = (sr.device_hit_tokens * ps, sr.host_hit_tokens * ps,
                                  sr.storage_hit_tokens * ps)
            else:
                prompt, output = layout.prompt_output(req)
                sr = simulate_request(cache, rid, prompt, output, req.extra_key)
                dev, host, sto = sr.device_hit_tokens, sr.host_hit_tokens, sr.storage_hit_tokens
            hit = _account(res, dev, host, sto, req.input_len)
            if req.cache_outcomes is not None:
                measured = res.engine_outcomes = res.engine_outcomes or {}
                for k, v in req.cache_outcomes.items():
                    measured[k] = measured.get(k, 0) + v
            if req.cached_tokens is not None:
                engine_total += req.cached_tokens
                if req.cached_tokens != hit:
                    res.engine_mismatched_requests += 1
            if bar is not None and i % 64 == 63:
                bar.update(64)
        if bar is not None:
            bar.update(len(reqs) % 64)
    finally:
        if bar is not None:
            bar.close()
    if trace.format == "engine":
        res.engine_cached_tokens = engine_total
        if not page_ids:
            res.predicted_outcomes = {
                k: v for k, v in cache.counters.prompt_outcomes.items() if v}
    _finish(res, cache, ps, page_ids)
    return res


def _account(res: SimResult, dev: int, host: int, sto: int, input_len: int) -> int:
    """Adds one request's hits (capped at its input length, the cut taken off the deepest tier
    first) to `res`; returns its hit tokens."""
    over = dev + host + sto - input_len
    if over > 0:
        res.capped_tokens += over
        cut = min(over, sto)
        sto -= cut
        over -= cut
        cut = min(over, host)
        host -= cut
        over -= cut
        dev -= over
    hit = dev + host + sto
    res.requests += 1
    res.input_tokens += input_len
    res.device_hit_tokens += dev
    res.host_hit_tokens += host
    res.storage_hit_tokens += sto
    res.hit_requests += 1 if hit else 0
    res.per_request_hits.append(hit)
    return hit


def _finish(res: SimResult, cache: Any, ps: int, page_ids: bool) -> None:
    stats = dict(cache.stats.as_dict())
    if page_ids:  # the cache counted pages where it says tokens
        for k in list(stats):
            if k.endswith("_tokens") and k != "input_tokens":
                stats[k] *= ps
        stats["hit_tokens"] = sum(stats[k] for k in (
            "device_hit_tokens", "host_hit_tokens", "storage_hit_tokens"))
        stats["hit_rate"] = stats["hit_tokens"] / stats["input_tokens"] if stats[
            "input_tokens"] else 0.0
    res.cache_stats = stats
    close = getattr(cache, "close", None)
    if close is not None:
        close()


def replay_arrays(
    arrs: PageArrays,
    tiers: TierConfig,
    *,
    progress: bool | None = False,
    warmup: float = 0.0,
) -> SimResult:
    """`replay(..., mode="pages")` of a block trace read into `PageArrays` (no `Request`s): the
    same page-id sequences reach the same cache, so the result is the same counter for counter
    (tests/tools/test_fast.py). `warmup`: the first fraction of requests goes through the cache
    but is not counted in the result (its `cache_stats` count every request)."""
    from hicache.simulation import replay_request
    from tools.hitrate.fast import warmup_start

    if tiers.page_size != arrs.page_size:
        raise ConfigError(f"page size {tiers.page_size} != the arrays' {arrs.page_size}")
    ps = tiers.page_size
    n = arrs.requests
    lengths = np.diff(arrs.offsets)
    unbounded = 2 + int(lengths.sum()) + n
    cache = build_cache(tiers, unbounded, page_ids=True)
    res = SimResult(
        device_pages=tiers.device_pages if tiers.device_pages is not None else unbounded,
        host_pages=tiers.host_pages if tiers.host_pages is not None else unbounded,
        storage_pages=tiers.storage_pages,
    )
    pages, offsets, n_lookup, input_len = arrs.pages, arrs.offsets, arrs.n_lookup, arrs.input_len
    start = warmup_start(arrs, warmup)
    bar = _progress(n, progress, "replaying")
    step = 4096
    try:
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            # one tolist per chunk: Python ints for the cache, without a list per request kept
            chunk = pages[offsets[lo] : offsets[hi]].tolist()
            base = int(offsets[lo])
            for i in range(lo, hi):
                o, e = int(offsets[i]) - base, int(offsets[i + 1]) - base
                full = chunk[o:e]
                nl = int(n_lookup[i])
                inp = int(input_len[i])
                sr = replay_request(cache, str(i), full[:nl], full, None, inp)
                if i < start:
                    continue
                _account(res, sr.device_hit_tokens * ps, sr.host_hit_tokens * ps,
                         sr.storage_hit_tokens * ps, inp)
            if bar is not None:
                bar.update(hi - lo)
    finally:
        if bar is not None:
            bar.close()
    _finish(res, cache, ps, True)
    return res
