"""Faults injected on one tensor-parallel rank. L3: the real `file` backend, whose reads fail on
the rank named `fault_rank` in its extra config, loaded by module path
(`--hicache-storage-backend tests.engine.tp_faults:RankFaultyFileBackend`), so every rank
process builds it as it builds any backend. Start-up: `RankOneFailsToBuild`, the engine with
rank 1 failing while rank 0 waits in a collective (rank processes build the class rank 0 is)."""

from __future__ import annotations

import errno
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from engine.engine import Engine
from hicache_client.backend import Checked, StorageConfig
from storage_backends.file_backend import FileBackend

FAULTS = ("raise", "slow", "start")


class RankFaultyFileBackend(FileBackend):
    """`file`, except that on rank `fault_rank` every read fails: `fault: "raise"` is an I/O
    error (a disk or mount that broke under that rank), `"slow"` waits `slow_s` seconds and
    then reads nothing (a path to L3 that stalls), `"start"` fails the backend's construction
    there (a store that rank cannot open). `exists` answers truthfully on every rank, so the
    faulty rank believes the pages are there until it reads them."""

    def __init__(self, config: StorageConfig) -> None:
        extra = dict(config.extra)
        self.fault_rank = int(extra.pop("fault_rank", 1))
        self.fault = str(extra.pop("fault", "raise"))
        self.slow_s = float(extra.pop("slow_s", 2.0))
        if self.fault not in FAULTS:
            raise ValueError(f"fault must be one of {FAULTS}")
        self.faulty = config.tp_rank == self.fault_rank
        if self.faulty and self.fault == "start":
            raise OSError(errno.EACCES, f"injected: rank {config.tp_rank} cannot open the store")
        super().__init__(replace(config, extra=extra))
        self.failed_reads = 0

    def _get_checked(self, keys: Sequence[str], out: Sequence[memoryview]) -> list[Checked]:
        if not self.faulty:
            return super()._get_checked(keys, out)
        self.failed_reads += 1
        if self.fault == "raise":
            raise OSError(errno.EIO, "injected L3 read failure")
        time.sleep(self.slow_s)
        return [Checked(-1, None)] * len(keys)


class RankOneFailsToBuild(Engine):
    """The engine, except that rank 1 fails just before the ranks agree on the pool size (as
    a rank whose tokenizer or weights do not load fails), leaving rank 0 in that collective."""

    def _num_device_pages(self, cfg: Any) -> int:
        if self.tp_rank == 1:
            raise RuntimeError("injected: rank 1 cannot size its pool")
        return super()._num_device_pages(cfg)
