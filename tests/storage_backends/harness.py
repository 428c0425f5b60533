"""How the storage contract suite reaches every backend.

Each backend ships a module `tests/storage_backends/harness_<name>.py` that defines
`HARNESS = Harness(...)`. `start(tmp_dir)` is a context manager that starts the real component
the backend talks to (a redis-server, a hicache-server, a directory...) and yields a factory:
each call returns a *new* backend object connected to that same store, standing for another
engine instance. The suite (`test_contract.py`) runs every test against every harness found.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache_client.backend import StorageBackend, StorageConfig

BackendFactory = Callable[..., StorageBackend]


@dataclass
class Harness:
    name: str
    # context manager factory: start(tmp_dir) -> yields a BackendFactory
    start: Callable[[Path], AbstractContextManager[BackendFactory]]
    marks: list[Any] = field(default_factory=list)
    # Why the real component cannot run here (None: it can); the suite skips the harness then.
    skip_reason: Callable[[], str | None] = lambda: None
    # Whether a corrupt record can be deleted by the backend (all of ours can).
    deletes_corrupt: bool = True
    # A function(factory, key, raw_bytes) that stores raw bytes under `key`, bypassing nothing
    # but hicache's own encoding; used to plant corrupt records. None: the suite uses batch_set.
    put_raw: Callable[[BackendFactory, str, bytes], None] | None = None


def discover() -> list[Harness]:
    """Every `HARNESS` defined in a `harness_*` module beside this one, sorted by name."""
    pkg = importlib.import_module("tests.storage_backends")
    found: list[Harness] = []
    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name.startswith("harness_"):
            m = importlib.import_module(f"tests.storage_backends.{mod.name}")
            found.append(m.HARNESS)
    return sorted(found, key=lambda h: h.name)


def config(extra: dict[str, Any] | None = None, record_bytes: int = 0) -> StorageConfig:
    """The `StorageConfig` of a harness's backend. `tp_rank` / `tp_size` in `extra` (a test
    standing for another rank of the same deployment) go to the config's fields, not `extra`."""
    extra = dict(extra or {})
    rank, size = int(extra.pop("tp_rank", 0)), int(extra.pop("tp_size", 1))
    return StorageConfig(extra=extra, namespace="00" * 32, record_bytes=record_bytes,
                         tp_rank=rank, tp_size=size)




@contextmanager
def closing_factory(build: Callable[..., StorageBackend]) -> Iterator[BackendFactory]:
    """A factory over `build` that remembers every backend it made and closes them on exit."""
    made: list[StorageBackend] = []

    def make(**extra: Any) -> StorageBackend:
        b = build(**extra)
        made.append(b)
        return b

    try:
        yield make
    finally:
        for b in made:
            b.close()
