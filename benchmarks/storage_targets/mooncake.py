"""`mooncake` backend and `mooncake-raw` (MooncakeDistributedStore's own `upsert_batch` /
`get_batch` of the same bytes; upsert, as the backend does) on one `mooncake_master` with a segment-holder process.

Mooncake binds every interface: these targets exist only inside the loopback-only network
namespace (`scripts/in_netns.sh python benchmarks/bench_storage.py ...`); elsewhere the module
defines no targets. HICACHE_BENCH_MOONCAKE_SEGMENT sets the contributed segment (default 1 GiB;
keep it above the benchmark's working set, or a full segment evicts silently and gets miss).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.common import leading
from benchmarks.storage_targets import BackendClient, Client, ClientFactory, Target, bench_config
from tests.storage_backends.mooncake_procs import (
    ENV,
    SegmentHolder,
    client_config,
    mooncake_master,
    skip_reason,
)

logger = logging.getLogger(__name__)

SEGMENT = int(os.environ.get("HICACHE_BENCH_MOONCAKE_SEGMENT", str(1 << 30)))


@contextmanager
def _store(tmp: Path) -> Iterator[str]:
    os.environ.update(ENV)  # the clients forked from here bind loopback only
    tmp.mkdir(parents=True, exist_ok=True)
    with mooncake_master(tmp) as master, SegmentHolder(master, SEGMENT, tmp):
        yield master


@contextmanager
def _start(tmp: Path) -> Iterator[ClientFactory]:
    with _store(tmp) as master:

        def make() -> Client:
            from storage_backends.mooncake_backend import MooncakeBackend

            return BackendClient(MooncakeBackend(bench_config(
                client_config(master, 0, staging_bytes=16 << 20, staging_buffers=1))))

        yield make


class RawMooncakeClient:
    """The store's plain byte API: `upsert_batch(keys, buffers)`, `get_batch(keys) -> bytes`."""

    def __init__(self, master: str) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", master)
        if rc != 0:
            raise RuntimeError(f"mooncake setup failed ({rc})")

    def put(self, keys: list[str], values: list[memoryview]) -> None:
        rc = self.store.upsert_batch(["raw/" + k for k in keys], values)
        if rc != 0:
            raise RuntimeError(f"upsert_batch failed ({rc})")

    def get(self, keys: list[str], out: list[memoryview]) -> int:
        hits = 0
        for data, o in zip(self.store.get_batch(["raw/" + k for k in keys]), out):
            if len(data) == len(o):
                o[:] = data
                hits += 1
        return hits

    def exists(self, keys: list[str]) -> int:
        flags = self.store.batch_is_exist(["raw/" + k for k in keys])
        return leading(f == 1 for f in flags)

    def close(self) -> None:
        self.store.close()


@contextmanager
def _start_raw(tmp: Path) -> Iterator[ClientFactory]:
    with _store(tmp) as master:
        yield lambda: RawMooncakeClient(master)


_reason = skip_reason()
if _reason:
    logger.warning("mooncake targets skipped: %s", _reason)
    TARGETS: list[Target] = []
else:
    TARGETS = [
        Target("mooncake", _start, marks=("mooncake",)),
        Target("mooncake-raw", _start_raw, baseline_of="mooncake", marks=("mooncake",)),
    ]
