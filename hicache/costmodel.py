"""Load-vs-recompute: how much of a cached prefix is cheaper to load than to compute.

`CostModel` keeps exponentially weighted moving averages (EWMA) of what was measured on this
machine: the bandwidth of each tier's load path (`host`: host -> device; `storage`: L3 -> host,
which is then also loaded host -> device) with a fixed per-operation latency, and the prefill
speed (tokens per second of forward). `plan()` depends on those measurements only (but once
per `remeasure_s` per tier it lets a load through to re-measure a tier it would skip): given
the host-resident and the storage-resident parts of a request's cached prefix (in prefix order:
device pages first, then host, then storage), it returns how many tokens to load from each
tier; the rest is recomputed. Loads are prefix-contiguous (a storage page is of no use without the host pages
before it), and each tier is either worth it or not (per-token costs are constant), so the plan
is: load the host part when that beats recomputing it, then the storage part when the host part
is loaded and loading beats recomputing it too. Until a quantity has been measured, its prior
(constructor argument) is used; with no prior, loading is assumed cheaper (the cache's old
behaviour). An engine calibrates every quantity before its first request
(`hicache.calibration`: a short forward, a host -> device copy, a short L3 read), recorded in
`calibration` and reported by `as_dict()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TIERS = ("host", "storage")


class Ewma:
    """Exponentially weighted moving average; `value` is None until the first sample."""

    def __init__(self, alpha: float = 0.3, prior: float | None = None) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.value = prior
        self.samples = 0

    def update(self, x: float) -> float:
        self.value = x if self.value is None or self.samples == 0 else (
            self.alpha * x + (1 - self.alpha) * self.value
        )
        self.samples += 1
        return self.value


@dataclass(frozen=True)
class LoadPlan:
    host_tokens: int  # leading host-resident tokens to load
    storage_tokens: int  # storage-resident tokens (after all the host ones) to load
    recompute_tokens: int  # cached tokens not loaded (computed instead)
    load_s: float  # estimated seconds of the loads
    recompute_s: float  # estimated seconds to compute what is not loaded


class CostModel:
    def __init__(
        self,
        bytes_per_token: int,
        *,
        alpha: float = 0.3,
        prefill_tokens_per_s: float | None = None,
        host_bytes_per_s: float | None = None,
        storage_bytes_per_s: float | None = None,
        host_latency_s: float = 0.0,
        storage_latency_s: float = 0.0,
        margin: float = 1.0,
        min_saving_s: float = 0.1,
        remeasure_s: float | None = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`margin` > 1 favours loading (load while load_s < margin * recompute_s).
        `min_saving_s`: a load is replaced by recomputation only when that is estimated to save
        at least this many seconds. NOTE: below it the estimates are within the noise of the
        measurements they come from, and a plan that flips between runs would make the tiers'
        hit counts depend on timing for no gain worth having.
        `remeasure_s`: a tier judged not worth loading is never loaded, so never measured again;
        once this long has passed without a measurement of it, one plan loads it anyway (and so
        re-measures it), so that a backend that was slow for a while and recovered is used again.
        None: never. The price is at most one slower-than-recomputing load per tier per period."""
        if bytes_per_token < 1:
            raise ValueError("bytes_per_token must be >= 1")
        self.bytes_per_token = bytes_per_token
        self.margin = margin
        self.min_saving_s = min_saving_s
        self.prefill = Ewma(alpha, prefill_tokens_per_s)
        self.bandwidth = {
            "host": Ewma(alpha, host_bytes_per_s),
            "storage": Ewma(alpha, storage_bytes_per_s),
        }
        self.latency = {"host": Ewma(alpha, host_latency_s), "storage": Ewma(alpha, storage_latency_s)}
        self.remeasure_s = remeasure_s
        self._clock = clock
        # When each tier was last measured (or let through to be): priors count as measured.
        now = clock()
        self._measured_at = {t: now for t in TIERS}
        self.remeasures = 0  # plans that loaded a tier only to measure it again
        # What the start-up calibration measured (tokens, bytes, seconds, rates; `error`s).
        self.calibration: dict[str, Any] = {}

    def as_dict(self) -> dict[str, Any]:
        """The current estimates (EWMAs; None: not measured) and the start-up calibration."""
        return {
            "bytes_per_token": self.bytes_per_token,
            "prefill_tokens_per_s": self.prefill.value,
            "host_bytes_per_s": self.bandwidth["host"].value,
            "storage_bytes_per_s": self.bandwidth["storage"].value,
            "storage_samples": self.bandwidth["storage"].samples,
            "calibration": dict(self.calibration),
        }

    # -- measurements ---------------------------------------------------------------------------

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A forward computed `tokens` prompt tokens in `seconds`."""
        if tokens > 0 and seconds > 0:
            self.prefill.update(tokens / seconds)

    def calibrate_prefill(self, tokens: int, seconds: float) -> None:
        """The start-up forward: observed, and recorded in `calibration`."""
        self.observe_prefill(tokens, seconds)
        self.calibration.update(prefill_tokens=tokens, prefill_seconds=seconds,
                                prefill_tokens_per_s=tokens / seconds if seconds > 0 else None)

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """`nbytes` came from `tier` in `seconds` (one batch: latency is folded into the
        bandwidth unless `observe_latency` is also fed)."""
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; known: {', '.join(TIERS)}")
        if nbytes > 0 and seconds > 0:
            self.bandwidth[tier].update(nbytes / seconds)
            self._measured_at[tier] = self._clock()

    def observe_latency(self, tier: str, seconds: float) -> None:
        self.latency[tier].update(max(0.0, seconds))

    # -- the decision ---------------------------------------------------------------------------

    def load_seconds(self, tier: str, tokens: int) -> float | None:
        """Estimated seconds to bring `tokens` from `tier` to the device (None: unknown)."""
        if tokens <= 0:
            return 0.0
        nbytes = tokens * self.bytes_per_token
        host_bw = self.bandwidth["host"].value
        if host_bw is None:
            return None
        s = (self.latency["host"].value or 0.0) + nbytes / host_bw
        if tier == "storage":
            bw = self.bandwidth["storage"].value
            if bw is None:
                return None
            s += (self.latency["storage"].value or 0.0) + nbytes / bw
        return s

    def recompute_seconds(self, tokens: int) -> float | None:
        speed = self.prefill.value
        if tokens <= 0:
            return 0.0
        return None if not speed else tokens / speed

    def load_saving(self, tier: str, tokens: int) -> float | None:
        """Estimated seconds that loading `tokens` from `tier` saves over recomputing them
        (negative: recomputing is faster). None while the prefill speed is unmeasured. A load
        path not measured yet counts as free, as in `plan` (until measured, loading is the
        default, and the first load measures it)."""
        comp = self.recompute_seconds(tokens)
        if comp is None:
            return None
        return comp - (self.load_seconds(tier, tokens) or 0.0)

    def _worth(self, tier: str, tokens: int) -> tuple[bool, float, float]:
        if tokens <= 0:
            return True, 0.0, 0.0
        load = self.load_seconds(tier, tokens)
        comp = self.recompute_seconds(tokens)
        if load is None or comp is None:
            return True, load or 0.0, comp or 0.0  # unmeasured: load (the cache's default)
        worth = load < self.margin * comp or load - comp < self.min_saving_s
        if not worth and self._due_for_measurement(tier):
            worth = True
        return worth, load, comp

    def _due_for_measurement(self, tier: str) -> bool:
        """True once per `remeasure_s` without a measurement of `tier` (see `__init__`)."""
        if self.remeasure_s is None:
            return False
        now = self._clock()
        if now - self._measured_at[tier] < self.remeasure_s:
            return False
        self._measured_at[tier] = now  # one load per period, even before its measurement lands
        self.remeasures += 1
        return True

    def plan(self, host_tokens: int, storage_tokens: int, page_size: int = 1) -> LoadPlan:
        """How many of the `host_tokens` then `storage_tokens` cached tokens to load."""
        host_tokens -= host_tokens % page_size
        storage_tokens -= storage_tokens % page_size
        load_s = recompute_s = 0.0
        take_host = take_storage = 0
        ok, ls, cs = self._worth("host", host_tokens)
        if ok:
            take_host, load_s = host_tokens, ls
            ok, ls, cs2 = self._worth("storage", storage_tokens)
            if ok:
                take_storage, load_s = storage_tokens, load_s + ls
            else:
                recompute_s = cs2
        else:
            recompute_s = cs + (self.recompute_seconds(storage_tokens) or 0.0)
        cached = host_tokens + storage_tokens
        return LoadPlan(take_host, take_storage, cached - take_host - take_storage, load_s,
                        recompute_s)
