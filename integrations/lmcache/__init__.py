"""Deprecated: use `hicache_client.lmcache` (LMCache names the module
`hicache_client.lmcache.adapter`; `integrations.lmcache.adapter` warns once and re-exports it)."""
