"""Contract harness for the `hicache` backend: one real `hicache-server` process on a free
loopback port, shared by every backend object the suite makes. The clients use the default
same-host data path (a shared-memory region per connection; `harness_hicache_tcp` covers TCP)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hicache_client.remote.backend import HiCacheServerBackend
from tests.storage_backends.harness import BackendFactory, Harness, config
from tests.storage_backends.hicache_server_proc import hicache_server


@contextmanager
def _start(tmp: Path) -> Iterator[BackendFactory]:
    with hicache_server(tmp, capacity="1GiB", auth_token="contract-token") as srv:

        def make(**extra: Any) -> HiCacheServerBackend:
            cfg = {"url": srv.url, "auth_token": "contract-token", **extra}
            return HiCacheServerBackend(config(cfg))

        yield make


# The server stores opaque bytes, so planting a raw record is a plain batch_set.
HARNESS = Harness(name="hicache", start=_start, put_raw=None)
