"""Contract harness for the in-process reference backend."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hicache.memory_backend import MemoryBackend
from tests.storage_backends.harness import BackendFactory, Harness, config


@contextmanager
def _start(tmp: Path) -> Iterator[BackendFactory]:
    shared = f"contract-{uuid.uuid4().hex}"

    def make(**extra: Any) -> MemoryBackend:
        return MemoryBackend(config({"shared": shared, **extra}))

    yield make


def _put_raw(factory: BackendFactory, key: str, raw: bytes) -> None:
    b = factory()
    assert isinstance(b, MemoryBackend)
    b.raw_put(key, raw)


HARNESS = Harness(name="memory", start=_start, put_raw=_put_raw)
