"""Simulated mode: the same tree, policies and decisions as the real cache, with no tensors.

`HiRadixCache(HiCacheConfig(simulated=True, ...), num_device_pages=..., num_host_pages=...,
sim_storage=SimStorage(...))` drives the exact code the engine runs; only the bytes do not move.
Transfers complete instantly. `simulate_request` is the request lifecycle an engine follows
(prefetch, acquire, compute, insert, release), so replaying a trace through it predicts the
engine's hit counters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from hicache.admission import NO_HINTS, CacheHints
from hicache.sim_storage import SimStorage

if TYPE_CHECKING:
    from hicache.hiradix import HiRadixCache

__all__ = ["SimStorage", "SimulatedRequest", "replay_request", "simulate_request"]


class SimulatedRequest(NamedTuple):
    cached_tokens: int  # prompt tokens served from the cache (all tiers)
    device_hit_tokens: int
    host_hit_tokens: int
    storage_hit_tokens: int
    computed_tokens: int  # prompt tokens that had to be prefilled


def simulate_request(
    cache: HiRadixCache,
    request_id: str,
    prompt: Sequence[int],
    output: Sequence[int] = (),
    extra_key: str | None = None,
    hints: CacheHints = NO_HINTS,
) -> SimulatedRequest:
    """Run one request through `cache` as the engine does, one request at a time.

    The engine matches `prompt[:-1]` (the last prompt token is always computed, to get logits)
    and inserts `prompt + output` when the request finishes.
    """
    prompt = list(prompt)
    return replay_request(
        cache, request_id, prompt[:-1], prompt + list(output), extra_key, len(prompt), hints
    )


def replay_request(
    cache: HiRadixCache,
    request_id: str,
    lookup: Sequence[int],
    full: Sequence[int],
    extra_key: str | None = None,
    input_tokens: int | None = None,
    hints: CacheHints = NO_HINTS,
) -> SimulatedRequest:
    """The request lifecycle with the looked-up and the inserted sequences given apart:
    prefetch and acquire `lookup`, allocate pages for the rest of `full`, insert `full` (with
    the request's cache `hints`, as the engine's scheduler passes them).

    `simulate_request` is this with `lookup = prompt[:-1]`, `full = prompt + output`. A caller
    that maps every page to one id (a cache of page size 1 over page ids, which makes the same
    decisions page for page: see tools/hitrate) passes the id sequences directly.
    """
    if input_tokens is None:
        input_tokens = len(lookup) + 1
    cache.prefetch(request_id, lookup, extra_key=extra_key)
    acq = cache.acquire(lookup, extra_key=extra_key, request_id=request_id,
                        input_tokens=input_tokens)
    ps = cache.page_size
    need = len(full) // ps - len(acq.device_pages)
    pages = list(acq.device_pages)
    if need > 0:
        new = cache.alloc_device(need)
        if new is None:
            # Not even eviction made room: the engine would retract; the simulator caches nothing.
            cache.release(acq.node)
            return SimulatedRequest(acq.cached_tokens, acq.device_hit_tokens,
                                    acq.host_hit_tokens, acq.storage_hit_tokens,
                                    input_tokens - acq.cached_tokens)
        pages += new
    cache.insert(full, pages, extra_key=extra_key, priority=hints.priority,
                 skip_write=hints.skip_cache_write, retention_s=hints.retention_seconds)
    cache.release(acq.node)
    return SimulatedRequest(acq.cached_tokens, acq.device_hit_tokens, acq.host_hit_tokens,
                            acq.storage_hit_tokens, input_tokens - acq.cached_tokens)
