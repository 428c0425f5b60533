"""HiCache core: a tiered (device / host / storage) KV cache over a page-granular radix tree.

Imports nothing from `engine`, `storage_backends` or `tools`; depends on torch, numpy, xxhash
(page record checksums) and the standard library only.

The names below are loaded on first use (PEP 562), so importing one leaf module (`hicache.codec`,
`hicache.errors`, ...) loads that module alone, not the tree and its torch pools: the thin client
distribution (clients/hicache-client) ships those leaves without the rest of the core.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.config import HiCacheConfig
    from hicache.errors import (
        CapacityError,
        ConfigError,
        HiCacheError,
        StorageCorrupt,
        StorageError,
        StorageUnavailable,
    )
    from hicache.hiradix import Acquired, HiRadixCache, InsertResult, MatchResult
    from hicache.keys import namespace_seed, page_keys
    from hicache.simulation import SimStorage, simulate_request
    from hicache.stats import CacheStats
    from hicache.storage import (
        BackendStats,
        PageCodec,
        StorageBackend,
        StorageConfig,
        create_backend,
        known_backends,
        register_backend,
    )

# public name -> the module that defines it
_SOURCES = {
    "HiCacheConfig": "config",
    "CapacityError": "errors",
    "ConfigError": "errors",
    "HiCacheError": "errors",
    "StorageCorrupt": "errors",
    "StorageError": "errors",
    "StorageUnavailable": "errors",
    "Acquired": "hiradix",
    "HiRadixCache": "hiradix",
    "InsertResult": "hiradix",
    "MatchResult": "hiradix",
    "namespace_seed": "keys",
    "page_keys": "keys",
    "SimStorage": "simulation",
    "simulate_request": "simulation",
    "CacheStats": "stats",
    "BackendStats": "storage",
    "PageCodec": "storage",
    "StorageBackend": "storage",
    "StorageConfig": "storage",
    "create_backend": "storage",
    "known_backends": "storage",
    "register_backend": "storage",
}

__all__ = [
    "Acquired",
    "HiRadixCache",
    "InsertResult",
    "MatchResult",
    "SimStorage",
    "simulate_request",
    "BackendStats",
    "CacheStats",
    "CapacityError",
    "ConfigError",
    "HiCacheConfig",
    "HiCacheError",
    "PageCodec",
    "StorageBackend",
    "StorageConfig",
    "StorageCorrupt",
    "StorageError",
    "StorageUnavailable",
    "create_backend",
    "known_backends",
    "namespace_seed",
    "page_keys",
    "register_backend",
]


def __getattr__(name: str) -> Any:
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module 'hicache' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hicache.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
