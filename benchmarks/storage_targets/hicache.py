"""`hicache` backend against a real `hicache-server` started on a free loopback port (or an
existing one: HICACHE_BENCH_HICACHE_URL, with HICACHE_BENCH_HICACHE_TOKEN if it wants one).

`hicache` uses the default client and server: same host, so the client reads pages in place from
the server's shared-memory store and writes them through its own region (no page byte crosses
TCP). `hicache-region` turns the store off (`--shm-store-bytes 0`: reads go through the region
too, one copy more); `hicache-tcp` is the default server with a `"shm": false` client (ZeroMQ
frames over loopback TCP). The three data paths are measured side by side. Each has a
`-sealed` twin whose client seals every record (`encryption_key`: AES-256-GCM, hicache_client.remote.seal),
so the cost of encryption is read off the same run, path by path.

The server's memory capacity is HICACHE_BENCH_HICACHE_CAPACITY (default 8GiB): keep it above the
benchmark's working set, or the numbers include evictions.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.storage_targets import BackendClient, Client, ClientFactory, Target, bench_config


@contextmanager
def _server(tmp: Path, args: tuple[str, ...] = ()) -> Iterator[tuple[str, str | None]]:
    url = os.environ.get("HICACHE_BENCH_HICACHE_URL")
    if url:
        yield url, os.environ.get("HICACHE_BENCH_HICACHE_TOKEN")
        return
    from tests.storage_backends.hicache_server_proc import hicache_server

    capacity = os.environ.get("HICACHE_BENCH_HICACHE_CAPACITY", "8GiB")
    tmp.mkdir(parents=True, exist_ok=True)
    with hicache_server(tmp, capacity=capacity, args=["--log-level", "WARNING", *args]) as srv:
        yield srv.url, None


@contextmanager
def _start(
    tmp: Path, name: str = "hicache", shm: bool = True, args: tuple[str, ...] = (),
    seal: bool = False,
) -> Iterator[ClientFactory]:
    from hicache_client.remote.backend import HiCacheServerBackend

    with _server(tmp / name, args) as (url, token):

        def make() -> Client:
            extra: dict[str, Any] = {"url": url, "timeout_ms": 30000, "shm": shm}
            if token:
                extra["auth_token"] = token
            if seal:
                extra["encryption_key"] = _BENCH_KEY
            return BackendClient(HiCacheServerBackend(bench_config(extra)))

        yield make


_BENCH_KEY = "5e" * 32  # a fixed AES-256 key: the benchmark measures the cost, not secrecy

TARGETS = [
    Target("hicache", _start),
    Target("hicache-region", partial(_start, name="hicache-region",
                                     args=("--shm-store-bytes", "0"))),
    Target("hicache-tcp", partial(_start, name="hicache-tcp", shm=False)),
    Target("hicache-sealed", partial(_start, name="hicache-sealed", seal=True)),
    Target("hicache-region-sealed", partial(_start, name="hicache-region-sealed",
                                            args=("--shm-store-bytes", "0"), seal=True)),
    Target("hicache-tcp-sealed", partial(_start, name="hicache-tcp-sealed", shm=False,
                                         seal=True)),
]
