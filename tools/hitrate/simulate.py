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

from hicache.config import HiCacheConfig
from hicache.errors import ConfigError
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
    cache_stats: dict[str, float] = field(default_factory=dict)
    device_pages: int = 0  # the capacities actually used (unbounded resolved)
    host_pages: int = 0
    storage_pages: int | None = 0

    @property
    def hit_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens


def build_cache(tiers: TierConfig, unbounded_pages: int) -> Any:
    """A simulated `HiRadixCache`; unbounded tiers get `unbounded_pages` pages."""
    from hicache.hiradix import HiRadixCache
    from hicache.simulation import SimStorage

    kwargs: dict[str, Any] = dict(
        page_size=tiers.page_size,
        write_policy=tiers.write_policy,
        eviction_policy=tiers.eviction_policy,
        eviction_config=dict(tiers.eviction_config),
        prefetch_policy=tiers.prefetch_policy,
        simulated=True,
        synchronous=True,
    )
    if tiers.prefetch_threshold is not None:
        kwargs["prefetch_threshold"] = tiers.prefetch_threshold
    if tiers.load_back_threshold is not None:
        kwargs["load_back_threshold"] = tiers.load_back_threshold
    config = HiCacheConfig(**kwargs)
    device = tiers.device_pages if tiers.device_pages is not None else unbounded_pages
    host = tiers.host_pages if tiers.host_pages is not None else unbounded_pages
    storage = None
    if tiers.storage_pages is None or tiers.storage_pages > 0:
        if not host:
            raise ConfigError(
                "a storage tier needs a host tier (--host): L3 pages reach the "
                "device through host memory"
            )
        storage = SimStorage(capacity_pages=tiers.storage_pages)
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
) -> SimResult:
    """Replays every request of `trace` through a fresh simulated cache."""
    from hicache.simulation import simulate_request

    layout = Layout(trace, tiers.page_size, ignore_output=ignore_output)
    reqs = trace.requests
    # Enough pages for everything the trace could ever insert (an unbounded tier).
    unbounded = 2
    for r in reqs:
        n_out = 0 if ignore_output else r.output_len
        n_in = len(r.blocks) * (trace.block_size or 0) + 1 if r.blocks is not None else r.input_len
        unbounded += (n_in + n_out) // tiers.page_size + 1
    cache = build_cache(tiers, unbounded)
    res = SimResult(
        device_pages=tiers.device_pages if tiers.device_pages is not None else unbounded,
        host_pages=tiers.host_pages if tiers.host_pages is not None else unbounded,
        storage_pages=tiers.storage_pages,
    )
    engine_total = 0
    bar = _progress(len(reqs), progress, "replaying")
    try:
        for i, req in enumerate(reqs):
            prompt, output = layout.prompt_output(req)
            sr = simulate_request(cache, req.rid or str(i), prompt, output, req.extra_key)
            dev, host, sto = sr.device_hit_tokens, sr.host_hit_tokens, sr.storage_hit_tokens
            over = dev + host + sto - req.input_len
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
            res.input_tokens += req.input_len
            res.device_hit_tokens += dev
            res.host_hit_tokens += host
            res.storage_hit_tokens += sto
            res.hit_requests += 1 if hit else 0
            res.per_request_hits.append(hit)
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
    stats = cache.stats
    res.cache_stats = dict(stats.as_dict()) if hasattr(stats, "as_dict") else {}
    close = getattr(cache, "close", None)
    if close is not None:
        close()
    return res
