"""Sizes for `hicache-hitrate`: parsing `--device/--host/--storage` (tokens, pages, bytes or
'unbounded') and the KV bytes per token of a Hugging Face checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from hicache_client import units
from hicache_client.errors import ConfigError

_UNBOUNDED = {"unbounded", "inf", "infinite", "unlimited"}


def parse_size(text: str) -> tuple[str, float] | None:
    """`'2GiB'` -> ('bytes', 2147483648); `'4096'`/`'4k'` -> ('tokens', ...); `'64p'` ->
    ('pages', 64); `'unbounded'` -> None. The units are `hicache_client.units.parse_size`'s, with a
    bare number counting tokens."""
    if text.strip().lower() in _UNBOUNDED:
        return None
    try:
        size = units.parse_size(text, bare="tokens")
    except ConfigError as e:
        raise ConfigError(f"bad size: {e}; or 'unbounded'") from None
    return (size.unit, size.value)


def to_pages(
    spec: tuple[str, float] | None, page_size: int, kv_bytes_per_token: float | None, flag: str
) -> int | None:
    if spec is None:
        return None
    kind, v = spec
    if kind == "pages":
        return int(v)
    if kind == "tokens":
        return int(v // page_size)
    if not kv_bytes_per_token:
        raise ConfigError(
            f"{flag} is given in bytes: pass --kv-bytes-per-token N, --model NAME or "
            "--model-path DIR "
            "(or use tokens / pages)"
        )
    return int(v / kv_bytes_per_token // page_size)


# Bytes per element of the floating-point KV dtypes (torch's names); also read by traces.py.
FLOAT_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
_DTYPE_BYTES = {**FLOAT_DTYPE_BYTES, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}


def kv_bytes_from_model(path: str, kv_dtype: str | None = None, tp: int = 1) -> float:
    """KV bytes per token from a HF checkpoint's config.json (`path`: the directory, the file,
    or a model name `resolve_model_path` knows, e.g. hicache-demo): 2 * layers * kv_heads *
    head_dim * dtype bytes, or for MLA checkpoints (DeepSeek-V2/V3: `kv_lora_rank` set) one latent per
    layer, layers * (kv_lora_rank + qk_rope_head_dim) * dtype bytes. Per rank under `tp`-way
    tensor parallelism: kv_heads / tp heads (one when kv_heads < tp); the MLA latent whole."""
    from engine.demo_model import resolve_model_path

    path = str(resolve_model_path(path))  # a demo name, or a path that must exist
    cfg_path = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    try:
        cfg = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--model-path: {cfg_path} not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--model-path: {cfg_path} is not JSON ({e.msg})") from None
    cfg = cfg.get("text_config", cfg)
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(
            f"--model-path: {cfg_path} lacks {e} (need num_hidden_layers, "
            "num_attention_heads, hidden_size or head_dim)"
        ) from None
    dtype = kv_dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    if dtype not in _DTYPE_BYTES:
        raise ConfigError(f"unknown KV dtype {dtype!r}; known: {', '.join(_DTYPE_BYTES)}")
    if cfg.get("kv_lora_rank"):  # MLA: one latent [kv_c | k_pe] per token and layer
        latent = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
        return float(units.kv_bytes_per_token(layers, 1, latent, _DTYPE_BYTES[dtype], mla=True))
    if tp < 1:
        raise ConfigError(f"--tp must be >= 1, got {tp}")
    kv_heads = max(1, kv_heads // tp)  # fewer KV heads than ranks: replicated
    return float(units.kv_bytes_per_token(layers, kv_heads, head_dim, _DTYPE_BYTES[dtype]))
