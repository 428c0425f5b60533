"""Sizes and KV arithmetic shared by the cache, the backends and the tools.

`parse_size` is the one parser of human sizes (``4096``, ``512MiB``, ``8GB``, ``64p``, ``2k``
tokens); `parse_bytes` is its byte-only form; `kv_bytes_per_token` is the one formula for the KV
bytes one token takes.
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

from hicache_client.errors import ConfigError

Unit = Literal["bytes", "tokens", "pages"]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_BYTE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_TOKEN_UNITS = {"t": 1, "tok": 1, "token": 1, "tokens": 1}
_PAGE_UNITS = {"p": 1, "page": 1, "pages": 1}
# A bare multiplier ("8G", "2k"): binary for bytes (8G = 8 GiB), decimal for tokens (2k = 2000).
_BARE_BINARY = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
_BARE_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9}


class Size(NamedTuple):
    unit: Unit  # what the number counts
    value: float  # how many of them


def parse_size(text: str | int | float, *, bare: Unit = "bytes") -> Size:
    """A size with its unit: bytes (``B``, ``KB``/``MB``/``GB``/``TB`` decimal, ``KiB``..``PiB``
    binary), pages (``64p``, ``64 pages``) or tokens (``4096 tokens``, ``4096t``).

    A number without a unit, or with a bare multiplier (``8G``, ``2k``), counts `bare`: bytes
    take binary multipliers (``8G`` = 8 GiB, as in ``--max-memory 8G``), tokens decimal ones
    (``2k`` = 2000 tokens). Raises `ConfigError` (a ValueError) on anything else.
    """
    if isinstance(text, bool):
        raise ConfigError(f"not a size: {text!r}")
    if isinstance(text, int | float):
        if text < 0:
            raise ConfigError(f"size {text!r} is negative")
        return Size(bare, float(text))
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ConfigError(
            f"not a size: {text!r} (examples: 4096, 512MiB, 8GiB, 500MB, 64p, 2k tokens)"
        )
    number, suffix = float(m.group(1)), m.group(2).lower()
    if suffix in _BYTE_UNITS:
        return Size("bytes", number * _BYTE_UNITS[suffix])
    if suffix in _PAGE_UNITS:
        return Size("pages", number)
    if suffix in _TOKEN_UNITS:
        return Size("tokens", number)
    if suffix == "":
        return Size(bare, number)
    bare_units = _BARE_BINARY if bare == "bytes" else _BARE_DECIMAL
    if bare != "pages" and suffix in bare_units:
        return Size(bare, number * bare_units[suffix])
    raise ConfigError(f"bad size unit {m.group(2)!r} in {text!r}")


def parse_bytes(text: str | int | float, *, what: str = "size") -> int:
    """A whole number of bytes from ``4096``, ``512MiB``, ``8GiB``, ``8GB``, ``8G`` (= 8 GiB)
    or an int. Raises `ConfigError` naming `what` otherwise."""
    try:
        size = parse_size(text)
    except ConfigError as e:
        raise ConfigError(f"{what}: {e}") from None
    if size.unit != "bytes":
        raise ConfigError(f"{what}: {text!r} is in {size.unit}, expected bytes")
    if size.value != int(size.value):
        raise ConfigError(f"{what}: {text!r} is not a whole number of bytes")
    return int(size.value)


def kv_bytes_per_token(
    num_layers: int, kv_heads: int, head_dim: int, itemsize: int, *, mla: bool = False
) -> int:
    """Bytes of KV one token takes: K and V (MHA/GQA), or one latent (`mla`: DeepSeek's
    multi-head latent attention, `kv_heads` 1 and `head_dim` the latent's width), per layer,
    per KV head, `head_dim` elements of `itemsize` bytes."""
    return (1 if mla else 2) * num_layers * kv_heads * head_dim * itemsize
