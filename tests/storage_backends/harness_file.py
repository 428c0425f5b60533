"""Contract harness for the `file` backend: one temp directory shared by every object."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from storage_backends.file_backend import FileBackend
from tests.storage_backends.harness import BackendFactory, Harness, config


@contextmanager
def _start(tmp: Path) -> Iterator[BackendFactory]:
    root = tmp / "pages"

    def make(**extra: Any) -> FileBackend:
        return FileBackend(config({"path": str(root), **extra}))

    yield make


def _put_raw(factory: BackendFactory, key: str, raw: bytes) -> None:
    b = factory()
    assert isinstance(b, FileBackend)
    path = b.path_of(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw)
    b.close()


HARNESS = Harness(name="file", start=_start, put_raw=_put_raw)
