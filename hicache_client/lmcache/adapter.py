"""`HiCacheConnectorAdapter`: how LMCache 0.5.x finds our connector, with no change to LMCache.

LMCache builds a remote connector through `ConnectorManager`, which asks each adapter in turn
whether it `can_parse` the URL. Its built-in adapters are found by scanning its own package; a
third-party one is loaded from the engine config as a *remote storage plugin*::

    remote_storage_plugins: ["hicache"]
    extra_config:
      remote_storage_plugin.hicache.module_path: hicache_client.lmcache.adapter
      remote_storage_plugin.hicache.class_name: HiCacheConnectorAdapter
      remote_storage_plugin.hicache.url: hicache://127.0.0.1:7480

For each plugin LMCache creates one `RemoteBackend` whose connector URL is the virtual
`plugin://hicache`; this adapter claims it (and `plugin://hicache.<instance>`, and a plain
`hicache://host:port` when one is given as `remote_url`), and reads the real address and every
other setting from `extra_config` (`hicache_client.lmcache.settings`).
"""

from __future__ import annotations

from typing import Any

from lmcache.v1.storage_backend.connector import ConnectorAdapter

from hicache_client.lmcache.connector import HiCacheConnector
from hicache_client.lmcache.settings import PLUGIN_SCHEME, PLUGIN_TYPE, SCHEME, plugin_type


class HiCacheConnectorAdapter(ConnectorAdapter):
    """Claims `hicache://host:port` and `plugin://hicache[.instance]`."""

    def __init__(self) -> None:
        super().__init__(SCHEME)

    def can_parse(self, url: str) -> bool:
        if url.startswith(SCHEME):
            return True
        if url.startswith(PLUGIN_SCHEME):
            return plugin_type(url[len(PLUGIN_SCHEME):]) == PLUGIN_TYPE
        return False

    def create_connector(self, context: Any) -> HiCacheConnector:
        return HiCacheConnector(
            loop=context.loop,
            local_cpu_backend=context.local_cpu_backend,
            config=context.config,
            url=context.url,
            metadata=context.metadata,
            plugin_name=getattr(context, "plugin_name", None),
        )
