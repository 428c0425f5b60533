"""`HiCacheConfig`: every knob of the tiered cache, validated once at construction."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hicache_client.errors import ConfigError

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
MEM_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
IO_BACKENDS = ("direct", "kernel")
HOST_MEMORY_MODES = ("full", "buffer_only")

# NOTE: SGLang defaults to page_size=1, which with an L3 backend means one storage key per token.
# We default to 32 tokens a page: one record per page keeps per-key overhead (a file, a Redis key,
# a network round trip) amortised, while prefixes are still matched at a fine granularity.
DEFAULT_PAGE_SIZE = 32
# SGLang's prefetch_threshold (tokens): the floor of a storage prefetch when none is configured.
DEFAULT_PREFETCH_THRESHOLD = 256


@dataclass(frozen=True)
class HiCacheConfig:
    """Configuration of a `HiRadixCache`. Sizes are in tokens unless the name says otherwise."""

    page_size: int = DEFAULT_PAGE_SIZE
    # Host pool size: `host_size_gb` when > 0, else `host_ratio` x the device pool.
    host_ratio: float = 2.0
    host_size_gb: float = 0.0
    # full: host memory is a cache tier (L2). buffer_only: it only stages pages between the device
    # and L3 (SGLang's --hicache-host-memory-mode); a host copy is dropped once its pages are in
    # L3 (backup acked) or on the device (loaded back). Needs a storage tier.
    host_memory_mode: str = "full"
    write_policy: str = "write_through"
    # write_through_selective: a node is backed up once this many requests have matched it.
    write_through_threshold: int = 2
    io_backend: str = "direct"
    mem_layout: str = "layer_first"
    # L3: a backend name from the registry (None = no storage tier) and its extra config.
    storage_backend: str | None = None
    storage_extra_config: Mapping[str, Any] = field(default_factory=dict)
    # best_effort: take what has arrived when the scheduler reaches the request; wait_complete;
    # timeout (the default): wait at most the budget below. With best_effort a request reaching
    # an idle engine is admitted before its prefetch has read anything.
    prefetch_policy: str = "timeout"
    # A storage prefetch shorter than this many tokens is not started (a hard floor). None (the
    # default): the floor is DEFAULT_PREFETCH_THRESHOLD (256, SGLang's), and a shorter gap is
    # prefetched too when the cost model's measurements say loading it saves enough time over
    # recomputing it (`hicache.prefetch.PREFETCH_MIN_SAVING_S`).
    prefetch_threshold: int | None = None
    # Pending prefetches hold at most this share of the host pool (SGLang: about half).
    prefetch_max_host_share: float = 0.5
    # timeout policy: wait at most base + per_ki_token * (tokens / 1024) seconds.
    prefetch_timeout_base: float = 1.0
    prefetch_timeout_per_ki_token: float = 0.25
    # Pages per storage batch (one batch_exists / batch_get / batch_set call).
    storage_batch_pages: int = 128
    # Host -> device load-back of fewer tokens than this is skipped (recomputing is cheaper).
    load_back_threshold: int = 10
    # Load a cached part while its measured load time < load_margin x its recompute time (the
    # cost model; larger favours loading: 1e9 always loads).
    load_margin: float = 1.0
    eviction_policy: str = "lru"
    eviction_config: Mapping[str, Any] = field(default_factory=dict)
    # Which backed-up pages are written to L3 (`hicache.admission`): always, reuse:N,
    # frequency[:HALF_LIFE_REQUESTS].
    storage_admission: str = "always"
    # The longest soft pin a request's `retention_seconds` may ask for (longer asks are cut to
    # this); 0: retention hints are ignored.
    max_retention_seconds: float = 3600.0
    # Attribute every prompt token to a hit tier or a miss cause (hicache.attribution).
    miss_attribution: bool = True
    # Seconds a failed backend is left alone before it is tried again (doubles up to 30 s).
    storage_retry_backoff: float = 1.0
    # Run transfers inline instead of on background threads (deterministic; used by tests).
    synchronous: bool = False
    # No tensors at all: same tree, same policies, same decisions (hit-rate analysis).
    simulated: bool = False

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        check(self.page_size >= 1, f"page_size must be >= 1, got {self.page_size}")
        check(self.host_ratio > 0, f"host_ratio must be > 0, got {self.host_ratio}")
        check(self.host_size_gb >= 0, f"host_size_gb must be >= 0, got {self.host_size_gb}")
        check(
            self.host_memory_mode in HOST_MEMORY_MODES,
            f"unknown host_memory_mode {self.host_memory_mode!r}; "
            f"known: {', '.join(HOST_MEMORY_MODES)}",
        )
        check(
            self.write_policy in WRITE_POLICIES,
            f"unknown write_policy {self.write_policy!r}; known: {', '.join(WRITE_POLICIES)}",
        )
        check(
            self.write_through_threshold >= 1,
            f"write_through_threshold must be >= 1, got {self.write_through_threshold}",
        )
        check(
            self.io_backend in IO_BACKENDS,
            f"unknown io_backend {self.io_backend!r}; known: {', '.join(IO_BACKENDS)}",
        )
        check(
            self.mem_layout in MEM_LAYOUTS,
            f"unknown mem_layout {self.mem_layout!r}; known: {', '.join(MEM_LAYOUTS)}",
        )
        check(
            self.prefetch_policy in PREFETCH_POLICIES,
            f"unknown prefetch_policy {self.prefetch_policy!r}; "
            f"known: {', '.join(PREFETCH_POLICIES)}",
        )
        check(
            self.prefetch_threshold is None or self.prefetch_threshold >= 0,
            "prefetch_threshold must be >= 0",
        )
        check(
            0 < self.prefetch_max_host_share <= 1,
            f"prefetch_max_host_share must be in (0, 1], got {self.prefetch_max_host_share}",
        )
        check(self.prefetch_timeout_base >= 0, "prefetch_timeout_base must be >= 0")
        check(self.prefetch_timeout_per_ki_token >= 0, "prefetch_timeout_per_ki_token must be >= 0")
        check(self.storage_batch_pages >= 1, "storage_batch_pages must be >= 1")
        check(self.load_back_threshold >= 0, "load_back_threshold must be >= 0")
        check(self.load_margin > 0, "load_margin must be > 0")
        check(self.storage_retry_backoff >= 0, "storage_retry_backoff must be >= 0")
        check(
            isinstance(self.storage_extra_config, Mapping),
            "storage_extra_config must be a mapping",
        )
        check(isinstance(self.eviction_config, Mapping), "eviction_config must be a mapping")
        check(self.max_retention_seconds >= 0, "max_retention_seconds must be >= 0")
        # Validates the policy name and its config keys now, not at the first eviction.
        from hicache.admission import make_admission
        from hicache.eviction import make_policy

        make_policy(self.eviction_policy, self.eviction_config)
        make_admission(self.storage_admission)

    def prefetch_timeout(self, n_tokens: int) -> float:
        """Seconds the `timeout` prefetch policy waits for a prefetch of `n_tokens` tokens."""
        return self.prefetch_timeout_base + self.prefetch_timeout_per_ki_token * n_tokens / 1024
