"""`EngineArgs`: every setting of the engine, named after SGLang's flags (underscores for dashes).

One comment per field: the CLI turns them into `--help` text. Validation happens in
`__post_init__` and raises `ConfigError` (a `ValueError`) naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from hicache.admission import make_admission
from hicache.config import (
    DEFAULT_PAGE_SIZE,
    HOST_MEMORY_MODES,
    IO_BACKENDS,
    MEM_LAYOUTS,
    PREFETCH_POLICIES,
    WRITE_POLICIES,
    HiCacheConfig,
)
from hicache_client.errors import ConfigError

SCHEDULE_POLICIES = ("fcfs", "lpm")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# Keys of --hicache-storage-backend-extra-config that tune the cache itself (as in SGLang);
# they are taken out before the rest goes to the backend.
CACHE_EXTRA_KEYS = (
    "prefetch_threshold",
    "prefetch_max_host_share",
    "prefetch_timeout_base",
    "prefetch_timeout_per_ki_token",
    "storage_batch_pages",
    "write_through_threshold",
    "load_back_threshold",
    "load_margin",
    "storage_retry_backoff",
)


def _json_obj(value: str | Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    if value is None or value == "":
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{name} is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise ConfigError(f"{name} must be a JSON object, got {type(obj).__name__}")
    return obj


@dataclass
class EngineArgs:
    # Hugging Face checkpoint directory (config.json + safetensors); None = the embedded demo model.
    model_path: str | None = None
    # Tokenizer directory when it differs from the model path.
    tokenizer_path: str | None = None
    # Weights: auto (the checkpoint's safetensors) or dummy (random weights made on the device from config.json alone, seeded by random_seed: a model's real shape without its checkpoint, for benchmarks; --model-path may then name a shipped config, e.g. llama-3.1-8b).
    load_format: str = "auto"
    # Name of the model in the namespace of cached pages; default: a fingerprint of the checkpoint.
    model_id: str | None = None
    # Tokens per KV page (one L3 record per page).
    page_size: int = DEFAULT_PAGE_SIZE
    # Weights and KV dtype: auto (float32 on CPU, the checkpoint's dtype on CUDA), float32, ...
    dtype: str = "auto"
    # Device: auto (cuda when available, else cpu), cpu, cuda, cuda:N.
    device: str = "auto"
    # Attention kernels: auto (triton on CUDA once it matches torch in a start-up self-check, else torch), torch (SDPA), triton (paged, GPU).
    attention_backend: str = "auto"
    # Do not capture the decode step in CUDA graphs (CUDA + triton backend only).
    disable_cuda_graph: bool = False
    # Largest decode batch replayed from a CUDA graph (larger batches run eagerly).
    cuda_graph_max_bs: int = 64
    # Tensor parallelism: ranks (processes) that split the model's heads and MLP columns and each hold their shard of the KV cache (one device each on CUDA; gloo on CPU, NCCL on CUDA).
    tp_size: int = 1
    # Seconds a tensor-parallel collective waits for the other ranks before it fails (a dead or diverged rank becomes an error, never a hang).
    dist_timeout: int = 300
    # Port for the tensor-parallel process group on 127.0.0.1 (default: a free port).
    nccl_port: int | None = None
    # Check after every step that all tensor-parallel ranks' caches and schedulers are in the same state (one more collective per step; for tests and debugging).
    enable_tp_state_check: bool = False
    # Longest sequence (prompt + output) in tokens; default: the model's max_position_embeddings.
    context_length: int | None = None
    # Size of the device KV pool in tokens (rounded down to pages); None = from mem_fraction_static.
    max_total_tokens: int | None = None
    # Fraction of free device memory for the KV pool (CUDA); on CPU a share of a 256 MiB budget.
    mem_fraction_static: float = 0.5
    # Requests decoded together at most.
    max_running_requests: int = 64
    # Most prompt tokens prefilled in one step (a longer prompt is prefilled in chunks).
    chunked_prefill_size: int = 2048
    # Order of waiting requests: fcfs (arrival) or lpm (longest cached prefix first).
    schedule_policy: str = "fcfs"
    # Turn prefix caching off (every prompt is computed from scratch).
    disable_radix_cache: bool = False
    # Device eviction policy: lru, lfu, slru, priority, fifo, mru.
    radix_eviction_policy: str = "lru"
    # JSON object of eviction policy settings (e.g. {"protected_threshold": 2} for slru).
    radix_eviction_policy_config: str | dict[str, Any] | None = None
    # Enable the host (L2) tier and, with a storage backend, the L3 tier.
    enable_hierarchical_cache: bool = False
    # Host pool size as a multiple of the device pool (when hicache_size is 0).
    hicache_ratio: float = 2.0
    # Host pool size in GB (0 = use hicache_ratio).
    hicache_size: float = 0.0
    # Host memory: full (an L2 cache tier) or buffer_only (only stages pages to and from L3).
    hicache_host_memory_mode: str = "full"
    # When pages are copied to host: write_through, write_through_selective, write_back.
    hicache_write_policy: str = "write_through"
    # Host <-> device copy method: direct (indexed copies through a staging buffer) or kernel
    # (a Triton page-copy kernel on CUDA; on CPU the direct path unless TRITON_INTERPRET=1).
    hicache_io_backend: str = "direct"
    # Host pool layout: layer_first, page_first, page_first_direct.
    hicache_mem_layout: str = "layer_first"
    # L3 backend name (file, redis, hicache, mooncake, lmcache, hf3fs, memory); None = no L3.
    hicache_storage_backend: str | None = None
    # JSON object for the L3 backend; prefetch_threshold / prefetch_timeout_* tune the cache.
    hicache_storage_backend_extra_config: str | dict[str, Any] | None = None
    # When a request with an L3 prefix may start: best_effort, wait_complete, timeout (default:
    # wait for the prefetch at most prefetch_timeout_base + prefetch_timeout_per_ki_token x
    # tokens / 1024 seconds, both settable in the extra config).
    hicache_storage_prefetch_policy: str = "timeout"
    # Which backed-up pages are written to L3: always, reuse:N (once hit N times on device/host)
    # or frequency[:HALF_LIFE] (a count doubled on each use, halved every HALF_LIFE requests;
    # written at 2). See docs/retention.md.
    hicache_storage_admission: str = "always"
    # The longest soft pin a request's retention_seconds may ask for (longer is cut to it);
    # 0: retention hints are ignored.
    max_retention_seconds: float = 3600.0
    # Run cache transfers inline instead of on background threads (deterministic, slower).
    hicache_synchronous: bool = False
    # Seed of sampling for requests without their own seed.
    random_seed: int = 0
    # Path of a JSONL log with one line per finished request (for `hicache-hitrate`).
    request_log: str | None = None
    # HTTP server bind address (loopback by default).
    host: str = "127.0.0.1"
    # HTTP server port.
    port: int = 30000
    # Serve Prometheus metrics at /metrics.
    enable_metrics: bool = False
    # Require this key as a Bearer token on every HTTP request (None = open).
    api_key: str | None = None
    # Ignore unknown fields in request bodies instead of refusing them with a 400.
    allow_unknown_fields: bool = False
    # JSON object publishing KV cache events over ZeroMQ, as in vLLM/SGLang, e.g. {"publisher":
    # "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"} (docs/deployment.md).
    kv_events_config: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        check(self.page_size >= 1, f"page_size must be >= 1, got {self.page_size}")
        check(self.dtype in DTYPES, f"unknown dtype {self.dtype!r}; known: {', '.join(DTYPES)}")
        check(
            self.load_format in LOAD_FORMATS,
            f"unknown load_format {self.load_format!r}; known: {', '.join(LOAD_FORMATS)}",
        )
        check(
            self.attention_backend in ATTENTION_BACKENDS,
            f"unknown attention_backend {self.attention_backend!r}; "
            f"known: {', '.join(ATTENTION_BACKENDS)}",
        )
        check(
            self.schedule_policy in SCHEDULE_POLICIES,
            f"unknown schedule_policy {self.schedule_policy!r}; "
            f"known: {', '.join(SCHEDULE_POLICIES)}",
        )
        check(
            self.context_length is None or self.context_length >= 2,
            f"context_length must be >= 2, got {self.context_length}",
        )
        check(
            self.max_total_tokens is None or self.max_total_tokens >= self.page_size,
            f"max_total_tokens must hold at least one page ({self.page_size} tokens), "
            f"got {self.max_total_tokens}",
        )
        check(
            0 < self.mem_fraction_static <= 1,
            f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}",
        )
        check(self.max_running_requests >= 1, "max_running_requests must be >= 1")
        check(self.tp_size >= 1, f"tp_size must be >= 1, got {self.tp_size}")
        check(self.dist_timeout >= 1, f"dist_timeout must be >= 1 s, got {self.dist_timeout}")
        check(
            self.nccl_port is None or 1 <= self.nccl_port <= 65535,
            f"nccl_port must be in 1..65535, got {self.nccl_port}",
        )
        check(self.cuda_graph_max_bs >= 0, "cuda_graph_max_bs must be >= 0")
        check(
            self.chunked_prefill_size >= self.page_size,
            f"chunked_prefill_size must be >= page_size ({self.page_size}), "
            f"got {self.chunked_prefill_size}",
        )
        check(
            self.hicache_host_memory_mode in HOST_MEMORY_MODES,
            f"unknown hicache_host_memory_mode {self.hicache_host_memory_mode!r}; "
            f"known: {', '.join(HOST_MEMORY_MODES)}",
        )
        check(
            self.hicache_write_policy in WRITE_POLICIES,
            f"unknown hicache_write_policy {self.hicache_write_policy!r}; "
            f"known: {', '.join(WRITE_POLICIES)}",
        )
        check(
            self.hicache_io_backend in IO_BACKENDS,
            f"unknown hicache_io_backend {self.hicache_io_backend!r}; "
            f"known: {', '.join(IO_BACKENDS)}",
        )
        check(
            self.hicache_mem_layout in MEM_LAYOUTS,
            f"unknown hicache_mem_layout {self.hicache_mem_layout!r}; "
            f"known: {', '.join(MEM_LAYOUTS)}",
        )
        check(
            self.hicache_storage_prefetch_policy in PREFETCH_POLICIES,
            f"unknown hicache_storage_prefetch_policy {self.hicache_storage_prefetch_policy!r}; "
            f"known: {', '.join(PREFETCH_POLICIES)}",
        )
        check(self.max_retention_seconds >= 0, "max_retention_seconds must be >= 0")
        make_admission(self.hicache_storage_admission)  # a bad spec fails at start-up
        check(self.hicache_ratio > 0, f"hicache_ratio must be > 0, got {self.hicache_ratio}")
        check(self.hicache_size >= 0, f"hicache_size must be >= 0, got {self.hicache_size}")
        check(
            not (self.hicache_storage_backend and not self.enable_hierarchical_cache),
            "hicache_storage_backend needs enable_hierarchical_cache",
        )
        check(
            not (self.disable_radix_cache and self.enable_hierarchical_cache),
            "disable_radix_cache and enable_hierarchical_cache exclude each other",
        )
        check(1 <= self.port <= 65535, f"port must be in 1..65535, got {self.port}")
        # Parse JSON now so a typo fails at start-up; to_hicache_config validates the rest.
        _json_obj(self.hicache_storage_backend_extra_config, "hicache_storage_backend_extra_config")
        _json_obj(self.radix_eviction_policy_config, "radix_eviction_policy_config")
        self.to_hicache_config()
        from engine.kv_events import KVEventsConfig

        KVEventsConfig.from_any(self.kv_events_config)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def storage_extra_config(self) -> dict[str, Any]:
        """The backend's part of the extra config (the cache-tuning keys removed)."""
        extra = _json_obj(
            self.hicache_storage_backend_extra_config, "hicache_storage_backend_extra_config"
        )
        return {k: v for k, v in extra.items() if k not in CACHE_EXTRA_KEYS}

    def to_hicache_config(self) -> HiCacheConfig:
        extra = _json_obj(
            self.hicache_storage_backend_extra_config, "hicache_storage_backend_extra_config"
        )
        tuning: dict[str, Any] = {k: extra[k] for k in CACHE_EXTRA_KEYS if k in extra}
        hierarchical = self.enable_hierarchical_cache
        return HiCacheConfig(
            page_size=self.page_size,
            host_ratio=self.hicache_ratio,
            host_size_gb=self.hicache_size,
            host_memory_mode=self.hicache_host_memory_mode,
            write_policy=self.hicache_write_policy,
            io_backend=self.hicache_io_backend,
            mem_layout=self.hicache_mem_layout,
            storage_backend=self.hicache_storage_backend if hierarchical else None,
            storage_extra_config=self.storage_extra_config(),
            prefetch_policy=self.hicache_storage_prefetch_policy,
            storage_admission=self.hicache_storage_admission,
            max_retention_seconds=self.max_retention_seconds,
            eviction_policy=self.radix_eviction_policy,
            eviction_config=_json_obj(
                self.radix_eviction_policy_config, "radix_eviction_policy_config"
            ),
            synchronous=self.hicache_synchronous,
            **tuning,
        )
