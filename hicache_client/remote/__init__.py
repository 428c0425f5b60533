"""The `hicache-server` wire protocol and its client.

- `wire`, `protocol`, `admin_protocol`: frames, the data-path messages, the admin messages
  (shared with the server, which imports them from here);
- `shm_files`: the /dev/shm files both sides map (the server's store layout, the checks);
- `backend`: `HiCacheServerBackend`, the `hicache` storage backend; it works through
  `connections` (pooled sockets, the circuit breaker), `shm` (a connection's shared region),
  `store` (reads and writes in place in the server's store), `seal` (AES-GCM sealed records)
  and `identity` (the server's Ed25519 key);
- `malloc`: glibc tuning for 1 MiB frames.
"""
