"""Contract harness for the `redis` backend: one real redis-server per test session."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.storage_backends.harness import BackendFactory, Harness, config
from tests.storage_backends.redis_servers import HAVE_REDIS, SKIP_REASON, redis_server


def redis_harness(name: str, serve: Callable[[Path], AbstractContextManager[Any]]) -> Harness:
    """A harness whose backends talk to what `serve(tmp)` starts (an object with `.url`)."""

    @contextmanager
    def start(tmp: Path) -> Iterator[BackendFactory]:
        from storage_backends.redis_backend import RedisBackend

        with serve(tmp) as server:

            def make(**extra: Any) -> RedisBackend:
                return RedisBackend(config({"url": server.url, **extra}))

            yield make

    def put_raw(factory: BackendFactory, key: str, raw: bytes) -> None:
        b = factory()
        b.raw_put(key, raw)  # type: ignore[attr-defined]
        b.close()

    return Harness(
        name=name,
        start=start,
        marks=[pytest.mark.redis, pytest.mark.skipif(not HAVE_REDIS, reason=SKIP_REASON)],
        put_raw=put_raw,
    )


HARNESS = redis_harness("redis", lambda tmp: redis_server(tmp / "redis"))
