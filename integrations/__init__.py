"""Plugins that put `hicache-server` (our shared page store) inside engines people already run.

- `integrations.sglang`: an SGLang HiCache storage backend (`--hicache-storage-backend dynamic`).
- `integrations.lmcache`: an LMCache remote connector (`remote_url: hicache://host:port`).

They live outside `hicache/` on purpose: the core imports nothing but torch, numpy and the
standard library, and these modules import an engine (SGLang, LMCache) and our `hicache` client
(`storage_backends.hicache_backend`). Dependency direction: `integrations -> storage_backends ->
hicache`; nothing of ours imports `integrations`.
"""
