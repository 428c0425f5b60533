"""Sizes for `hicache-hitrate`: parsing `--device/--host/--storage` (tokens, pages, bytes or
'unbounded') and the KV bytes per token of a Hugging Face checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

from hicache.errors import ConfigError

_BYTE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_TOKEN_UNITS = {"": 1, "t": 1, "tok": 1, "tokens": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_PAGE_UNITS = {"p": 1, "page": 1, "pages": 1}
_UNBOUNDED = {"unbounded", "inf", "infinite", "unlimited"}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> tuple[str, float] | None:
    """`'2GiB'` -> ('bytes', 2147483648); `'4096'`/`'4k'` -> ('tokens', ...); `'64p'` ->
    ('pages', 64); `'unbounded'` -> None."""
    if text.strip().lower() in _UNBOUNDED:
        return None
    m = _SIZE_RE.match(text)
    if not m:
        raise ConfigError(
            f"bad size {text!r}: use tokens (4096, 2M), pages (64p), bytes "
            "(2GiB, 500MB) or 'unbounded'"
        )
    value, unit = float(m.group(1)), m.group(2).lower()
    if unit in _TOKEN_UNITS:
        return ("tokens", value * _TOKEN_UNITS[unit])
    if unit in _PAGE_UNITS:
        return ("pages", value)
    if unit in _BYTE_UNITS:
        return ("bytes", value * _BYTE_UNITS[unit])
    raise ConfigError(f"bad size unit {m.group(2)!r} in {text!r}")


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
            f"{flag} is given in bytes: pass --kv-bytes-per-token N or --model-path DIR "
            "(or use tokens / pages)"
        )
    return int(v / kv_bytes_per_token // page_size)


_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "int8": 1,
}


def kv_bytes_from_model(path: str, kv_dtype: str | None = None) -> float:
    """2 * layers * kv_heads * head_dim * dtype bytes, from a HF checkpoint's config.json."""
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
    return float(2 * layers * kv_heads * head_dim * _DTYPE_BYTES[dtype])
