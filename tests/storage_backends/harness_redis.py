"""Contract harness for the `redis` backend: one real redis-server per test session."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.storage_backends.harness import BackendFactory, Harness, config
from tests.storage_backends.redis_servers import HAVE_REDIS, SKIP_REASON, redis_server


@contextmanager
def _start(tmp: Path) -> Iterator[BackendFactory]:
    from storage_backends.redis_backend import RedisBackend

    with redis_server(tmp / "redis") as server:

        def make(**extra: Any) -> RedisBackend:
            return RedisBackend(config({"url": server.url, **extra}))

        yield make


def _put_raw(factory: BackendFactory, key: str, raw: bytes) -> None:
    b = factory()
    b.raw_put(key, raw)  # type: ignore[attr-defined]
    b.close()


HARNESS = Harness(
    name="redis",
    start=_start,
    marks=[pytest.mark.redis, pytest.mark.skipif(not HAVE_REDIS, reason=SKIP_REASON)],
    put_raw=_put_raw,
)
