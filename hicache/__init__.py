"""HiCache core: a tiered (device / host / storage) KV cache over a page-granular radix tree.

Depends on torch, numpy and `hicache_client` (the page record codec, storage keys, errors and
the storage backend contract, shared with every backend and plugin); imports nothing from
`engine`, `storage_backends` or `tools`.

Nothing is imported here: each name is imported from the module that defines it
(`hicache.hiradix.HiRadixCache`, `hicache.config.HiCacheConfig`, `hicache.simulation.
simulate_request`, ...), so a torch-free module of the core (`hicache.lru`, used by
`hicache-server`) loads without torch. The storage types live in `hicache_client.backend`,
`hicache_client.codec`, `hicache_client.registry` and `hicache_client.errors`.
"""
