"""Plug-in targets for `benchmarks/bench_storage.py`.

Each module in this package defines `TARGETS: list[Target]`. A `Target` starts whatever its
store needs (a directory, a redis-server, a hicache-server...) and yields a *client factory*:
each call of the factory returns a new `Client` connected to that same store. Concurrent
benchmark clients run in separate processes (multiprocessing "fork"), each calling the
inherited factory once, so the factory must be safe to call after a fork (open connections
lazily, inside the call).

A target whose `baseline_of` names another target is that target's raw baseline (e.g.
`file-raw` for `file`: plain write/readinto of the same bytes); the benchmark reports the
backend's throughput as a ratio of its baseline measured in the same run.

A target may also carry the mark ``"vs:<other>"``: the benchmark then reports its ratio to
target ``<other>`` too (used by diagnostic targets such as ``file-io``, the backend's raw I/O
path without the record validation every `batch_get` does).

To add a backend: drop a module here with `TARGETS = [Target("mybackend", start), ...]`;
`discover_targets()` picks it up, nothing else to edit.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from hicache_client.backend import StorageBackend, StorageConfig
from hicache_client.errors import StorageError

logger = logging.getLogger(__name__)


@runtime_checkable
class Client(Protocol):
    """What the benchmark drives. Buffers are flat byte memoryviews holding whole records."""

    def put(self, keys: list[str], values: list[memoryview]) -> None:
        """Store every record (raise if one could not be stored)."""

    def get(self, keys: list[str], out: list[memoryview]) -> int:
        """Read records into `out` (each exactly the record's size); return the number of hits."""

    def exists(self, keys: list[str]) -> int:
        """Length of the leading run of `keys` present."""

    def close(self) -> None:
        """Release connections / files."""


ClientFactory = Callable[[], Client]

# The namespace the benchmark encodes its page records with; hicache backends built for it must
# use `bench_config()` so that batch_get accepts the records.
BENCH_NAMESPACE = bytes(32)


def bench_config(extra: dict[str, object] | None = None) -> StorageConfig:
    """A StorageConfig for a backend under benchmark (namespace = BENCH_NAMESPACE)."""
    return StorageConfig(extra=dict(extra or {}), namespace=BENCH_NAMESPACE.hex())


@dataclass(frozen=True)
class Target:
    name: str
    # start(tmp_dir) starts any services and yields a client factory; stops them on exit.
    start: Callable[[Path], AbstractContextManager[ClientFactory]]
    # Name of the target this one is the raw baseline of (None: a backend, not a baseline).
    baseline_of: str | None = None
    # Free-form tags ("redis", "slow", "needs-gpu"...) for filtering and reporting.
    marks: tuple[str, ...] = ()


class BackendClient:
    """Adapts any `hicache_client.backend.StorageBackend` to `Client`."""

    def __init__(self, backend: StorageBackend) -> None:
        self.backend = backend

    def put(self, keys: list[str], values: list[memoryview]) -> None:
        ok = self.backend.batch_set(keys, values)
        if not all(ok):
            raise StorageError(
                f"{self.backend.name}: {ok.count(False)} of {len(keys)} pages not stored"
            )

    def get(self, keys: list[str], out: list[memoryview]) -> int:
        return sum(self.backend.batch_get(keys, out))

    def exists(self, keys: list[str]) -> int:
        return self.backend.batch_exists(keys)

    def close(self) -> None:
        self.backend.close()


class UnverifiedBackendClient(BackendClient):
    """Diagnostic: reads through the backend's raw `_get_into`, skipping the validation
    (`verify_record`: CRC32 over the record) that `batch_get` adds. Never use outside a
    benchmark: it hands back records nobody checked."""

    def get(self, keys: list[str], out: list[memoryview]) -> int:
        lengths = self.backend._get_into(keys, out)
        return sum(1 for n, o in zip(lengths, out) if n == len(o))


def discover_targets(names: Sequence[str] | None = None) -> list[Target]:
    """Every `TARGETS` entry of every module in this package (sorted by name).

    `names`: keep only these targets, their baselines and their variants (targets named
    ``<name>-<variant>``, e.g. ``file-io``). A module that fails to import (a
    backend whose package is not installed) is skipped with a warning.
    """
    found: list[Target] = []
    for mod in pkgutil.iter_modules(__path__):
        if mod.name.startswith("_"):
            continue
        try:
            m = importlib.import_module(f"{__name__}.{mod.name}")
        except ImportError as e:
            logger.warning("storage target module %s skipped: %s", mod.name, e)
            continue
        found.extend(getattr(m, "TARGETS", []))
    found.sort(key=lambda t: t.name)
    if names:
        wanted = set(names)
        unknown = wanted - {t.name for t in found}
        if unknown:
            raise ValueError(
                f"unknown target(s) {sorted(unknown)}; known: {[t.name for t in found]}"
            )
        found = [
            t for t in found
            if t.name in wanted or t.baseline_of in wanted or t.name.split("-")[0] in wanted
        ]
    return found
