"""`hicache_client.lmcache`: an LMCache remote connector that keeps LMCache's KV chunks in our
`hicache-server` (`remote_storage_plugin.hicache.url: hicache://host:port`).

- `adapter.HiCacheConnectorAdapter`: what LMCache's engine config names (remote storage plugin
  `hicache`, see that module and docs/lmcache.md for the exact config);
- `connector.HiCacheConnector`: the `RemoteConnector` (exists / get / put / list / close, sync,
  async and batched);
- `records`: one LMCache chunk <-> one checksummed `PageCodec` record, namespaces, server keys;
- `settings`: the connector's settings from LMCache's `extra_config`;
- `client.ConnectorBackend`: the `hicache-server` client the connector drives.

Importing this package imports nothing of LMCache; its submodules `adapter` and `connector` do.
"""
