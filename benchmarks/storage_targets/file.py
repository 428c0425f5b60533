"""`file` backend and its raw baseline (plain write / readinto of the same bytes).

Two diagnostic targets say where the backend's time goes: `file-io` is its reads without the
record check; `file-raw-xxh3` is the raw baseline plus the one XXH3-64 pass over each record
that any checked read must make (the floor of a validated read on this machine).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import xxhash

from benchmarks.common import leading
from benchmarks.storage_targets import (
    BackendClient,
    Client,
    ClientFactory,
    Target,
    UnverifiedBackendClient,
    bench_config,
)


def _starter(
    wrap: type[BackendClient], dirname: str
) -> Callable[[Path], AbstractContextManager[ClientFactory]]:
    @contextmanager
    def start(tmp: Path) -> Iterator[ClientFactory]:
        from storage_backends.file_backend import FileBackend

        root = tmp / dirname

        def make() -> Client:
            return wrap(FileBackend(bench_config({"path": str(root)})))

        yield make

    return start


class RawFileClient:
    """The floor under the backend: one file per key, open/write/close and open/readinto/close,
    no temp file, no rename, no index, no validation."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def put(self, keys: list[str], values: list[memoryview]) -> None:
        for k, v in zip(keys, values):
            with open(self._path(k), "wb", buffering=0) as f:
                mv = memoryview(v)
                off = 0
                while off < len(mv):
                    off += f.write(mv[off:])

    def get(self, keys: list[str], out: list[memoryview]) -> int:
        hits = 0
        for k, o in zip(keys, out):
            try:
                with open(self._path(k), "rb", buffering=0) as f:
                    n = f.readinto(o)
            except FileNotFoundError:
                continue
            hits += n == len(o)
        return hits

    def exists(self, keys: list[str]) -> int:
        return leading(os.path.exists(self._path(k)) for k in keys)

    def close(self) -> None:
        pass


class RawHashedFileClient(RawFileClient):
    """The raw baseline plus one XXH3-64 pass over each record read (no header checks, no
    index): what a read that validates its bytes cannot do without."""

    def get(self, keys: list[str], out: list[memoryview]) -> int:
        hits = super().get(keys, out)
        for o in out:
            xxhash.xxh3_64_intdigest(o)
        return hits


@contextmanager
def _start_raw(tmp: Path) -> Iterator[ClientFactory]:
    root = tmp / "file-raw"
    yield lambda: RawFileClient(root)


@contextmanager
def _start_raw_hashed(tmp: Path) -> Iterator[ClientFactory]:
    root = tmp / "file-raw-xxh3"
    yield lambda: RawHashedFileClient(root)


TARGETS = [
    Target("file", _starter(BackendClient, "file-backend")),
    Target("file-raw", _start_raw, baseline_of="file"),
    # The backend's own I/O path, reads without record validation: where the time goes.
    Target("file-io", _starter(UnverifiedBackendClient, "file-io"),
           marks=("diagnostic", "vs:file-raw")),
    Target("file-raw-xxh3", _start_raw_hashed, marks=("diagnostic", "vs:file-raw")),
]
