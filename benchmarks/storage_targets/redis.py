"""`redis` backend and its raw baseline (pipelined redis-py SET / MGET), each against its own
real redis-server started on a free loopback port (or an existing one: HICACHE_BENCH_REDIS_URL,
whose keys under the bench prefixes are overwritten)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from benchmarks import storage_targets as st


@contextmanager
def _server_url(tmp: Path) -> Iterator[str]:
    url = os.environ.get("HICACHE_BENCH_REDIS_URL")
    if url:
        yield url
        return
    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server not installed (scripts/install_system_deps.sh)")
    from tests.storage_backends.redis_servers import redis_server

    with redis_server(tmp) as server:
        yield server.url


def _starter(
    wrap: type[st.BackendClient], dirname: str
) -> Callable[[Path], AbstractContextManager[st.ClientFactory]]:
    @contextmanager
    def start(tmp: Path) -> Iterator[st.ClientFactory]:
        from storage_backends.redis_backend import RedisBackend

        with _server_url(tmp / dirname) as url:

            def make() -> st.Client:
                return wrap(RedisBackend(st.bench_config(
                    {"url": url, "key_prefix": f"bench:{dirname}:", "socket_timeout": 30}
                )))

            yield make

    return start


class RawRedisClient:
    """The floor under the backend: a default redis-py client, pipelined SET, one MGET, one
    multi-key EXISTS; values copied into the caller's buffers like any real reader must."""

    PREFIX = b"bench:raw:"

    def __init__(self, url: str) -> None:
        import redis

        self.r: Any = redis.Redis.from_url(url, socket_timeout=30)

    def put(self, keys: list[str], values: list[memoryview]) -> None:
        p = self.r.pipeline(transaction=False)
        for k, v in zip(keys, values):
            p.set(self.PREFIX + k.encode(), v)
        p.execute()

    def get(self, keys: list[str], out: list[memoryview]) -> int:
        hits = 0
        for v, o in zip(self.r.mget([self.PREFIX + k.encode() for k in keys]), out):
            if v is not None and len(v) == len(o):
                o[:] = v
                hits += 1
        return hits

    def exists(self, keys: list[str]) -> int:
        # A count, not a leading run: the cheapest possible presence check.
        return int(self.r.exists(*[self.PREFIX + k.encode() for k in keys]))

    def close(self) -> None:
        self.r.close()


@contextmanager
def _start_raw(tmp: Path) -> Iterator[st.ClientFactory]:
    with _server_url(tmp / "redis-raw") as url:
        yield lambda: RawRedisClient(url)


TARGETS = [
    st.Target("redis", _starter(st.BackendClient, "redis"), marks=("redis",)),
    st.Target("redis-raw", _start_raw, baseline_of="redis", marks=("redis",)),
    # The backend's own I/O path, reads without record validation: where the time goes.
    st.Target("redis-io", _starter(st.UnverifiedBackendClient, "redis-io"),
           marks=("redis", "diagnostic", "vs:redis-raw")),
]
