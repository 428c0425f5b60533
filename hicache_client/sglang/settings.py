"""What the plugin reads from SGLang: its extra config and its storage config.

SGLang hands a dynamic backend one JSON object (`--hicache-storage-backend-extra-config`) that
also carries keys of its own (`SGLANG_KEYS`, found in sglang 0.5.23's source): the factory's
`backend_name` / `module_path` / `class_name`; the controller's `interface_v1`; `allocator`
(`"shm"`: the host pool allocator, `pool_host.common.get_allocator_type`); `file_storage_path`
(added by the radix cache when `--file-storage-path` is set); and the prefetch knobs and
`tp_lcm_size`, which SGLang pops before the backend sees the object except on the
prefill/decode-split decode-offload path (`DecodeKVCacheOffloadManager` passes the object as
parsed). Those are accepted and left to SGLang. Ours go to the `hicache-server` client
(`hicache_client.remote.backend`) or decide the namespace. Any other key is a typo, and an
error at start-up that names it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from hicache_client.errors import ConfigError
from hicache_client.keys import namespace_seed

# Keys SGLang itself reads from the extra config, which may reach the backend (see above).
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "allocator",
               "file_storage_path", "prefetch_threshold", "prefetch_timeout_base",
               "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
               "tp_lcm_size")
# Passed as they are to `HiCacheServerBackend` (see docs/hicache-server.md, client settings).
CLIENT_KEYS = ("url", "auth_token", "timeout_ms", "batch_keys", "batch_bytes", "tune_malloc",
               "shm", "shm_bytes", "shm_populate", "encryption_key", "token_proof",
               "server_public_key")
# The plugin's own.
PLUGIN_KEYS = ("model_id", "namespace_salt", "stage_bytes")
DEFAULT_STAGE_BYTES = 64 << 20
NAMESPACE_TAG = "sglang-hicache/v1"


@dataclass(frozen=True)
class PluginSettings:
    """The extra config, split by who reads it."""

    client: dict[str, Any]  # for HiCacheServerBackend(StorageConfig(extra=client))
    model_id: str  # names the model in the namespace; "" = SGLang's model_name
    namespace_salt: str  # any other discriminator (a deployment, a tenant)
    stage_bytes: int  # most record bytes per client call (a batch is cut in parts; bounds the
    # temporaries of the client's region / TCP paths)
    interface_v1: bool  # whether SGLang will call the zero-copy v1 methods


def parse_settings(extra: dict[str, Any] | None) -> PluginSettings:
    """Split and check the extra config; `ConfigError` names the first problem."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(SGLANG_KEYS) - set(CLIENT_KEYS) - set(PLUGIN_KEYS))
    if unknown:
        ours = CLIENT_KEYS + PLUGIN_KEYS
        hints = [f"{k!r}: did you mean {m[0]!r}?" for k in unknown
                 if (m := difflib.get_close_matches(k, ours + SGLANG_KEYS, n=1))]
        raise ConfigError(
            f"hicache SGLang plugin: unknown extra-config keys {unknown}"
            + (f" ({'; '.join(hints)})" if hints else "")
            + f"; known: {sorted(ours)} (and SGLang's {list(SGLANG_KEYS)})"
        )
    stage = extra.get("stage_bytes", DEFAULT_STAGE_BYTES)
    if not isinstance(stage, int) or isinstance(stage, bool) or stage <= 0:
        raise ConfigError(f"stage_bytes must be a positive integer, got {stage!r}")
    for key in ("model_id", "namespace_salt"):
        if not isinstance(extra.get(key, ""), str):
            raise ConfigError(f"{key} must be a string, got {extra[key]!r}")
    return PluginSettings(
        client={k: extra[k] for k in CLIENT_KEYS if k in extra},
        model_id=extra.get("model_id", ""),
        namespace_salt=extra.get("namespace_salt", ""),
        stage_bytes=stage,
        interface_v1=bool(extra.get("interface_v1", 0)),
    )


@dataclass(frozen=True)
class RankView:
    """The parts of SGLang's `HiCacheStorageConfig` that decide what a rank shares."""

    model_name: str
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    cp_rank: int  # attention context parallel: each rank holds a slice of every page
    cp_size: int
    dcp_rank: int  # decode context parallel (MLA shards)
    dcp_size: int
    is_mla: bool  # KV replicated across TP ranks: one copy, written by one rank
    is_writer: bool  # whether this rank stores pages (False: only reads)
    split_heads: bool  # heterogeneous TP (tp_lcm_size): not supported


def rank_view(storage_config: Any) -> RankView:
    """Read SGLang's storage config (any release with `HiCacheStorageConfig`'s fields; those a
    release lacks take their single-rank value)."""

    def get(name: str, default: Any) -> Any:
        value = getattr(storage_config, name, default)
        return default if value is None else value

    is_mla = bool(get("is_mla_model", False))
    tp_rank = int(get("tp_rank", 0))
    dcp_rank = int(get("dcp_rank", 0))
    writer = getattr(storage_config, "is_storage_writer", None)
    if writer is None:  # releases before DCP: MLA writes from rank 0, MHA from every rank
        writer = not is_mla or tp_rank == 0
    return RankView(
        model_name=str(get("model_name", "")),
        tp_rank=tp_rank,
        tp_size=int(get("tp_size", 1)),
        pp_rank=int(get("pp_rank", 0)),
        pp_size=int(get("pp_size", 1)),
        cp_rank=int(get("attn_cp_rank", 0)),
        cp_size=int(get("attn_cp_size", 1)),
        dcp_rank=dcp_rank,
        dcp_size=int(get("dcp_size", 1)),
        is_mla=is_mla,
        is_writer=bool(writer),
        split_heads=bool(get("should_split_heads", False)),
    )


def namespace_for(settings: PluginSettings, ranks: RankView, *, dtype: str, page_size: int,
                  layout: str, page_geometry: dict[str, Any]) -> bytes:
    """The 32-byte seed every key and record of this rank's pages carries.

    Two ranks share pages exactly when the seed is equal: same model (`model_id`, else SGLang's
    `model_name`), KV dtype, page size, host layout, page geometry (pool type, page shape, the
    byte regions of a page) and shard (tp rank/size for MHA; none for MLA, whose ranks hold the
    same KV; pp and context-parallel ranks always), and the same `namespace_salt`.
    """
    model = settings.model_id or ranks.model_name
    if not model:
        raise ConfigError("the namespace needs a model: SGLang gave no model_name; set model_id")
    shard: dict[str, Any] = {"pp": [ranks.pp_rank, ranks.pp_size]}
    if ranks.cp_size > 1:
        shard["cp"] = [ranks.cp_rank, ranks.cp_size]
    if ranks.dcp_size > 1:
        shard["dcp"] = [ranks.dcp_rank, ranks.dcp_size, ranks.tp_size]
    extra = json.dumps({
        "tag": NAMESPACE_TAG,
        "mla": ranks.is_mla,
        "shard": shard,
        "page": page_geometry,
        "salt": settings.namespace_salt,
    }, sort_keys=True)
    return namespace_seed(
        model_fingerprint=model,
        dtype=dtype,
        page_size=page_size,
        layout=layout,
        tp_rank=0 if ranks.is_mla else ranks.tp_rank,
        tp_size=1 if ranks.is_mla else ranks.tp_size,
        extra=extra,
    )


def storage_key(namespace: bytes, sglang_key: str) -> str:
    """Our key of an SGLang page key: SGLang's keys name token prefixes only (the same for every
    model and rank), so they are hashed with the namespace (64 lower-case hex characters)."""
    return hashlib.sha256(namespace + sglang_key.encode()).hexdigest()
