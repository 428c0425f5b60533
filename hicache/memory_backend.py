"""`memory`: an in-process reference backend, for tests and single-process use.

Objects built with the same `{"shared": NAME}` extra config share one store, which stands in for
"two engine instances on one store" inside one process.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import ClassVar

from hicache.lru import LRUByteStore
from hicache_client.backend import StorageBackend, StorageConfig
from hicache_client.units import parse_bytes


class _Store:
    def __init__(self, capacity_bytes: int) -> None:
        self.data: LRUByteStore[bytes] = LRUByteStore(capacity_bytes)
        self.lock = threading.Lock()


_shared: dict[str, _Store] = {}
_shared_lock = threading.Lock()


class MemoryBackend(StorageBackend):
    """Dict of records with an optional byte capacity and LRU eviction.

    Extra config: `capacity_bytes` (0 = unbounded; a number or a size such as "64MiB"),
    `shared` (name of a process-wide store).
    """

    name: ClassVar[str] = "memory"

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        capacity = parse_bytes(config.get("capacity_bytes", 0), what="capacity_bytes")
        shared = config.get("shared")
        if shared:
            with _shared_lock:
                self._store = _shared.setdefault(str(shared), _Store(capacity))
        else:
            self._store = _Store(capacity)

    def batch_exists(self, keys: Sequence[str]) -> int:
        self._count(exists_calls=1)
        s = self._store
        with s.lock:
            for i, k in enumerate(keys):
                if k not in s.data:
                    return i
            return len(keys)

    def _get_into(self, keys: Sequence[str], out: Sequence[memoryview]) -> list[int]:
        s = self._store
        res: list[int] = []
        with s.lock:
            for k, buf in zip(keys, out):
                v = s.data.get(k)
                if v is None:
                    res.append(-1)
                    continue
                dst = memoryview(buf).cast("B")
                if len(v) == len(dst):
                    dst[:] = v
                res.append(len(v))
        return res

    def _set_from(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]:
        s = self._store
        ok: list[bool] = []
        evicted = 0
        with s.lock:
            for k, v in zip(keys, values):
                dropped = s.data.put(k, bytes(memoryview(v).cast("B")))
                ok.append(dropped is not None)
                evicted += len(dropped or ())
            pages, nbytes = len(s.data), s.data.nbytes
        self._count(evicted_pages=evicted)
        self._set_gauge(stored_pages=pages, stored_bytes=nbytes)
        return ok

    def delete(self, keys: Sequence[str]) -> None:
        s = self._store
        n = 0
        with s.lock:
            for k in keys:
                n += s.data.pop(k) is not None
            pages, nbytes = len(s.data), s.data.nbytes
        self._count(deleted_pages=n)
        self._set_gauge(stored_pages=pages, stored_bytes=nbytes)

    def clear(self) -> None:
        s = self._store
        with s.lock:
            s.data.clear()
        self._set_gauge(stored_pages=0, stored_bytes=0)

    def raw_put(self, key: str, value: bytes) -> None:
        """Store `value` as-is, bypassing nothing but the caller's sense: for corruption tests."""
        s = self._store
        with s.lock:
            s.data.put(key, value)
