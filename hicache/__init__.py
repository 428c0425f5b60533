"""HiCache core: a tiered (device / host / storage) KV cache over a page-granular radix tree.

Imports nothing from `engine`, `storage_backends` or `tools`; depends on torch, numpy, xxhash
(page record checksums) and the standard library only.
"""

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
