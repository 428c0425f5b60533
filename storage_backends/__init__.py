"""L3 storage backends (file, redis, mooncake, lmcache, hf3fs) and `hicache-server`.

Each backend is declared once, as an entry point of the ``hicache.storage_backends`` group in
pyproject.toml, and found by name through `hicache_client.registry`; nothing is imported here.
The `hicache` backend (the client of `hicache-server`) lives in `hicache_client.remote`.
"""
