"""hicache-client: what an engine needs to share KV pages through HiCache storage, without torch.

- `errors`, `units`, `backoff`, `keys`: the error types, byte sizes, the circuit breaker, and the
  chained page keys every engine, server and plugin derives alike;
- `codec`: the page record (header, checksum, versions), checked once on every read;
- `backend`: the storage backend contract (`StorageBackend`, `StorageConfig`, `BackendStats`);
  `backend_util`: helpers backends share; `registry`: backends by name (entry points);
- `remote`: the `hicache-server` wire protocol and its client (the `hicache` backend);
- `sglang`, `lmcache`: the SGLang HiCacheStorage plugin and the LMCache remote connector.

Needs only pyzmq, msgpack and xxhash (and `cryptography` for sealed records); the plugins
import the engine they plug into. Nothing here imports `hicache` (the core), the engine, the
server or the tools.
"""
