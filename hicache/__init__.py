"""HiCache core: a tiered (device / host / storage) KV cache over a page-granular radix tree.

Depends on torch, numpy and `hicache_client` (the page record codec, storage keys, errors and
the storage backend contract, shared with every backend and plugin); imports nothing from
`engine`, `storage_backends` or `tools`.

The storage types have one home each: `hicache_client.backend` (`StorageBackend`,
`StorageConfig`, `BackendStats`), `hicache_client.codec` (`PageCodec`, page records),
`hicache_client.registry` (`create_backend`, `register_backend`), `hicache_client.errors`.
"""

from __future__ import annotations

from hicache.config import HiCacheConfig
from hicache.hiradix import HiRadixCache
from hicache.prefix_cache import Acquired, InsertResult, MatchResult
from hicache.sim_storage import SimStorage
from hicache.simulation import simulate_request
from hicache.stats import CacheStats

__all__ = [
    "Acquired",
    "CacheStats",
    "HiCacheConfig",
    "HiRadixCache",
    "InsertResult",
    "MatchResult",
    "SimStorage",
    "simulate_request",
]
