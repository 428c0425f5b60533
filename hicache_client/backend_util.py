"""Helpers the L3 backends share: their settings from `StorageConfig.extra` (and the
environment), unknown-key checks, and small batch utilities. The circuit breaker every networked
backend wraps its round trips in is `hicache_client.backoff.Backoff`; page records, whole or in
several buffers, are `hicache_client.codec`'s.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from hicache_client.backend import StorageConfig, byte_view
from hicache_client.errors import ConfigError

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = [
    "as_bool",
    "check_known_keys",
    "each_key_once",
    "leading_run",
    "setting",
]


# ------------------------------------------------------------------------------------------
# Config look-ups
# ------------------------------------------------------------------------------------------

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def as_bool(value: Any, key: str = "value") -> bool:
    """Parse a JSON/env boolean ("true", "1", True...) or raise `ConfigError`."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    s = str(value).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ConfigError(f"{key}: expected a boolean, got {value!r}")


def setting(
    config: StorageConfig,
    key: str,
    default: T,
    *,
    env: str | None = None,
    cast: Callable[[Any], T] | None = None,
) -> T:
    """`config.extra[key]`, else env var `env`, else `default`; converted with `cast`
    (default: the type of `default`; bool uses `as_bool`). A bad value raises `ConfigError`."""
    raw: Any
    if key in config.extra and config.extra[key] is not None:
        raw = config.extra[key]
    elif env and os.environ.get(env) not in (None, ""):
        raw = os.environ[env]
    else:
        return default
    conv = cast if cast is not None else _converter(default, key)
    try:
        value: Any = conv(raw)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}: bad value {raw!r} ({e})") from e
    return value


def _converter(default: object, key: str) -> Callable[[Any], Any]:
    """How to convert a raw setting whose default is `default`."""
    if isinstance(default, bool):
        return functools.partial(as_bool, key=key)
    if default is None:
        return lambda v: v
    conv: Callable[[Any], Any] = type(default)
    return conv


def check_known_keys(config: StorageConfig, known: Sequence[str], backend: str) -> None:
    """Reject extra-config keys a backend does not know (typos fail at start-up)."""
    unknown = sorted(set(config.extra) - set(known))
    if unknown:
        raise ConfigError(
            f"{backend} backend: unknown extra config key(s) {unknown}; known: {sorted(known)}"
        )


# ------------------------------------------------------------------------------------------
# Small utilities
# ------------------------------------------------------------------------------------------


def leading_run(flags: Sequence[bool] | Sequence[int]) -> int:
    """Length of the leading run of truthy flags: what `batch_exists` returns."""
    for i, f in enumerate(flags):
        if not f:
            return i
    return len(flags)


def each_key_once(
    keys: Sequence[str],
    out: Sequence[memoryview],
    get_into: Callable[[Sequence[str], Sequence[memoryview]], list[int]],
) -> list[int]:
    """`get_into(keys, out)` for a batch that names a key more than once: each key is read once
    (into its first buffer) and copied to the other buffers that asked for it. Per key, the
    stored length (-1: absent), as `get_into` returns."""
    first: dict[str, int] = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    idx = list(first.values())
    got = get_into([keys[i] for i in idx], [out[i] for i in idx])
    res = [-1] * len(keys)
    for i, n in zip(idx, got):
        res[i] = n
    for i, k in enumerate(keys):
        f = first[k]
        if i != f:
            res[i] = n = res[f]
            dst, src = byte_view(out[i]), byte_view(out[f])
            if n >= 0 and n == len(dst) == len(src):
                dst[:] = src
    return res
