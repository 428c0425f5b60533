"""Counters owned by the core. Exporters (Prometheus, JSON) live outside hicache.

Every field counts tokens unless its name says pages, bytes or seconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from hicache.attribution import no_attribution

# Where each storage-hit token goes (`CacheStats.storage_hit_outcomes`): a token L3 said it holds,
# when a request's prefetch asked (`storage_probed_tokens`), ends in exactly one of these.
STORAGE_HIT_OUTCOMES: tuple[str, ...] = (
    "reused",  # read from L3 and loaded for the request: a storage hit
    "already_cached",  # read, but the tree had the page meanwhile (served from device or host)
    "below_threshold",  # not read or not loaded: fewer tokens than the prefetch/load-back floor
    "recomputed_by_cost_model",  # recomputing them was measured cheaper than loading them
    "host_capacity",  # no host memory to read them into (or the prefetch share was used up)
    "device_capacity",  # read, but no device room to load them for the request
    "timeout",  # still on its way when the request was admitted (the prefetch policy)
    "read_failed",  # the read stopped at a page that was gone, or the backend failed
    "corrupt",  # the read stopped at a record that failed validation
    "evicted_before_use",  # read, but the prefix they extend left the tree before admission
    "cancelled",  # the request went away (abort, reset) before admission
)


def no_outcomes() -> dict[str, int]:
    return dict.fromkeys(STORAGE_HIT_OUTCOMES, 0)


@dataclass
class CacheStats:
    # Requests admitted through `HiRadixCache.acquire` and their prompt tokens.
    requests: int = 0
    input_tokens: int = 0
    # Leading prompt tokens found, by the tier they came from at admission.
    device_hit_tokens: int = 0  # already on the device (L1)
    host_hit_tokens: int = 0  # loaded back from host memory (L2)
    storage_hit_tokens: int = 0  # prefetched from L3 for this request, then loaded back
    # Requests with any hit, by the deepest tier that contributed.
    device_hit_requests: int = 0
    host_hit_requests: int = 0
    storage_hit_requests: int = 0
    # Movement between tiers.
    evicted_tokens: int = 0  # device copies dropped (L1 eviction)
    evicted_host_tokens: int = 0  # host copies dropped (L2 eviction)
    backup_tokens: int = 0  # device -> host writes completed
    backup_skipped_tokens: int = 0  # writes not done for lack of host space
    load_back_tokens: int = 0  # host -> device
    load_back_skipped_tokens: int = 0  # host hits not loaded (under threshold / no device room)
    # L3.
    prefetch_started: int = 0  # prefetch operations issued
    prefetch_skipped: int = 0  # not issued: below threshold, nothing in L3, or no host room
    prefetch_pages: int = 0  # pages read from L3 into host memory
    prefetch_tokens: int = 0
    # Pages read from L3 but not used: they arrived after the request was admitted, the request
    # went away, or another request had cached them meanwhile (duplicates).
    prefetch_revoked_pages: int = 0
    prefetch_bytes: int = 0
    prefetch_seconds: float = 0.0  # wall time spent in storage reads
    storage_backup_pages: int = 0  # pages written to L3
    storage_backup_skipped_pages: int = 0  # already present in L3
    storage_backup_bytes: int = 0
    storage_backup_seconds: float = 0.0
    storage_failed_pages: int = 0  # writes the backend refused
    # L3 admission (hicache.admission) and the per-request hints:
    storage_declined_pages: int = 0  # backed-up pages kept out of L3 (again after a later hit)
    storage_declined_rehit_pages: int = 0  # recomputed while in the declined sketch: L3 misses
    skip_write_pages: int = 0  # new pages of skip_cache_write requests (never below device)
    retention_requests: int = 0  # requests that set a soft pin (retention_seconds)
    retention_clamped: int = 0  # of those, cut to max_retention_seconds
    retention_expired: int = 0  # nodes whose pin ran out
    storage_errors: int = 0  # backend operations that raised
    corrupt_pages: int = 0  # records that failed validation on read
    # Tokens L3 held for the requests that asked it (leading run found by prefetch probes), and
    # the one outcome each of them came to (STORAGE_HIT_OUTCOMES; once every prefetch of a run
    # has ended, the outcomes sum to `storage_probed_tokens`).
    storage_probed_tokens: int = 0
    storage_hit_outcomes: dict[str, int] = field(default_factory=no_outcomes)
    # Every prompt token of the admitted requests by its one outcome: a hit per tier or a miss
    # with its cause (hicache.attribution.OUTCOMES); they sum to `input_tokens` (attribution on).
    prompt_outcomes: dict[str, int] = field(default_factory=no_attribution)

    @property
    def hit_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens."""
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def outcome(self, name: str, tokens: int) -> None:
        """Count `tokens` storage-hit tokens as having come to outcome `name`."""
        if tokens:
            self.storage_hit_outcomes[name] += tokens

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(asdict(self))
        d["hit_tokens"] = self.hit_tokens
        d["hit_rate"] = self.hit_rate
        return d

    def copy(self) -> CacheStats:
        return CacheStats(**asdict(self))
