"""Contract harness for `hf3fs`: a temporary directory stands in for the 3FS mount."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from storage_backends.hf3fs_backend import HF3FSBackend
from tests.storage_backends.harness import BackendFactory, Harness, config

# Small files so the suite stays light; slots big enough for the suite's records.
SLOT_BYTES = 256 * 1024
FILE_SIZE = 64 * SLOT_BYTES


def hf3fs_config(mount: Path, **extra: Any) -> dict[str, Any]:
    return {
        "mount_path": str(mount),
        "file_size": FILE_SIZE,
        "slot_bytes": SLOT_BYTES,
        "numjobs": 2,
        **extra,
    }


@contextmanager
def _start(tmp: Path) -> Iterator[BackendFactory]:
    mount = tmp / "hf3fs-mount"
    made: list[HF3FSBackend] = []

    def make(**extra: Any) -> HF3FSBackend:
        b = HF3FSBackend(config(hf3fs_config(mount, **extra)))
        made.append(b)
        return b

    try:
        yield make
    finally:
        for b in made:
            b.close()


HARNESS = Harness(name="hf3fs", start=_start)
