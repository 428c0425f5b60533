"""Deprecated: use `hicache_client.sglang` (`"module_path": "hicache_client.sglang"`)."""

from hicache_client.sglang import HiCacheServerStorage
from integrations import warn_moved

warn_moved("integrations.sglang", "hicache_client.sglang")

__all__ = ["HiCacheServerStorage"]
