"""`hf3fs` backend on a directory standing in for the 3FS mount (HICACHE_BENCH_HF3FS_MOUNT to
point it at a real mount), and its raw baseline: `pwrite` / `preadv` of the same bytes at fixed
slot offsets in one preallocated file, with no index and no validation."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.common import leading
from benchmarks.storage_targets import BackendClient, Client, ClientFactory, Target, bench_config

SLOT_BYTES = (4 << 20) + 4096  # the largest record the benchmark writes by default: 4 MiB
FILE_SIZE = int(os.environ.get("HICACHE_BENCH_HF3FS_FILE_SIZE", str(2 << 30)))


def _mount(tmp: Path) -> Path:
    return Path(os.environ.get("HICACHE_BENCH_HF3FS_MOUNT", str(tmp / "hf3fs-mount")))


@contextmanager
def _start(tmp: Path) -> Iterator[ClientFactory]:
    from storage_backends.hf3fs_backend import HF3FSBackend

    mount = _mount(tmp)

    def make() -> Client:
        return BackendClient(HF3FSBackend(bench_config(
            {"mount_path": str(mount), "file_size": FILE_SIZE, "slot_bytes": SLOT_BYTES,
             "numjobs": 4})))

    yield make


class RawSlotClient:
    """Fixed slots in one preallocated file; the key -> slot map lives in this process only."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDWR)
        self.nslots = FILE_SIZE // SLOT_BYTES
        self.slots: dict[str, int] = {}
        self.lock = threading.Lock()
        self.base = (os.getpid() * 7919) % self.nslots  # processes start at different slots

    def _slot(self, key: str, create: bool) -> int | None:
        with self.lock:
            s = self.slots.get(key)
            if s is None and create:
                s = (self.base + len(self.slots)) % self.nslots
                self.slots[key] = s
            return s

    def put(self, keys: list[str], values: list[memoryview]) -> None:
        for k, v in zip(keys, values):
            slot = self._slot(k, True)
            assert slot is not None
            os.pwrite(self.fd, v, slot * SLOT_BYTES)

    def get(self, keys: list[str], out: list[memoryview]) -> int:
        hits = 0
        for k, o in zip(keys, out):
            slot = self._slot(k, False)
            if slot is not None:
                hits += os.preadv(self.fd, [o], slot * SLOT_BYTES) == len(o)
        return hits

    def exists(self, keys: list[str]) -> int:
        return leading(self._slot(k, False) is not None for k in keys)

    def close(self) -> None:
        os.close(self.fd)


@contextmanager
def _start_raw(tmp: Path) -> Iterator[ClientFactory]:
    mount = _mount(tmp)
    mount.mkdir(parents=True, exist_ok=True)
    path = mount / "hf3fs-raw.data"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, FILE_SIZE)
    finally:
        os.close(fd)
    yield lambda: RawSlotClient(path)


TARGETS = [
    Target("hf3fs", _start),
    Target("hf3fs-raw", _start_raw, baseline_of="hf3fs"),
]
