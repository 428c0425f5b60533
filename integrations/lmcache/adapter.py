"""Deprecated: use `hicache_client.lmcache.adapter` (LMCache's `remote_storage_plugin` module)."""

from hicache_client.lmcache.adapter import HiCacheConnectorAdapter
from integrations import warn_moved

warn_moved("integrations.lmcache.adapter", "hicache_client.lmcache.adapter")

__all__ = ["HiCacheConnectorAdapter"]
