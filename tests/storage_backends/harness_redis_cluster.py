"""Contract harness for the `redis` backend on a real 3-node Redis Cluster."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.storage_backends.harness import BackendFactory, Harness, config
from tests.storage_backends.redis_servers import HAVE_REDIS, SKIP_REASON, redis_cluster


@contextmanager
def _start(tmp: Path) -> Iterator[BackendFactory]:
    from storage_backends.redis_backend import RedisBackend

    with redis_cluster(tmp / "cluster") as cluster:

        def make(**extra: Any) -> RedisBackend:
            return RedisBackend(config({"url": cluster.url, **extra}))

        yield make


def _put_raw(factory: BackendFactory, key: str, raw: bytes) -> None:
    b = factory()
    b.raw_put(key, raw)  # type: ignore[attr-defined]
    b.close()


HARNESS = Harness(
    name="redis_cluster",
    start=_start,
    marks=[pytest.mark.redis, pytest.mark.skipif(not HAVE_REDIS, reason=SKIP_REASON)],
    put_raw=_put_raw,
)
