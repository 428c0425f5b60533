"""L3 storage backends and `hicache-server`.

`BACKENDS` names the backends this source tree ships, as the distribution's
``hicache.storage_backends`` entry points do (pyproject.toml; a test keeps the two equal). The
registry (`hicache.registry`) reads it only when a name is not among the installed entry points:
a source tree on ``PYTHONPATH`` whose package metadata was never installed (a copied checkout, a
GPU machine that runs the tests in place) still finds `file`, `redis`, ... by name. Nothing is
imported here: each backend module is loaded when asked for.
"""

BACKENDS: dict[str, str] = {
    "file": "storage_backends.file_backend:FileBackend",
    "redis": "storage_backends.redis_backend:RedisBackend",
    "hicache": "storage_backends.hicache_backend:HiCacheServerBackend",
    "mooncake": "storage_backends.mooncake_backend:MooncakeBackend",
    "lmcache": "storage_backends.lmcache_backend:LMCacheBackend",
    "hf3fs": "storage_backends.hf3fs_backend:HF3FSBackend",
}
