"""An SGLang HiCache storage backend over our `hicache-server` (docs/sglang.md).

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "hicache", "module_path": "hicache_client.sglang",
        "class_name": "HiCacheServerStorage", "interface_v1": 1,
        "url": "tcp://127.0.0.1:7480"}'

Modules: `storage` (the `HiCacheStorage` subclass), `pages` (host pool pages as bytes, page
records), `settings` (extra config, namespace). Importing this package imports SGLang.
"""

from hicache_client.sglang.storage import HiCacheServerStorage

__all__ = ["HiCacheServerStorage"]
