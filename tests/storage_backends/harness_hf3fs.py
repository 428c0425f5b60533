"""Contract harness for `hf3fs`: a temporary directory stands in for the 3FS mount."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from storage_backends.hf3fs_backend import HF3FSBackend
from tests.storage_backends.harness import BackendFactory, Harness, closing_factory, config

# Slots for the suite's largest record (1 MiB payload), enough of them for its largest batch
# (128 pages); the file is preallocated once per harness.
SLOT_BYTES = (1 << 20) + 4096
FILE_SIZE = 192 * SLOT_BYTES


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
    with closing_factory(lambda **extra: HF3FSBackend(config(hf3fs_config(mount, **extra)))) as f:
        yield f


HARNESS = Harness(name="hf3fs", start=_start)
