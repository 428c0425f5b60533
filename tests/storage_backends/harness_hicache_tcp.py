"""Contract harness for the `hicache` backend on its TCP data path (`"shm": false`): page bytes
travel as ZeroMQ frames, as for a client on another host. `harness_hicache` covers the default
same-host path (a shared-memory region per connection)."""

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
            cfg = {"url": srv.url, "auth_token": "contract-token", "shm": False, **extra}
            return HiCacheServerBackend(config(cfg))

        yield make


HARNESS = Harness(name="hicache-tcp", start=_start, put_raw=None)
