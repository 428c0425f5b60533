"""`memory`: an in-process reference backend, for tests and single-process use.

Objects built with the same `{"shared": NAME}` extra config share one store, which stands in for
"two engine instances on one store" inside one process.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar

from hicache.storage import StorageBackend, StorageConfig


class _Store:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.data: OrderedDict[str, bytes] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()


_shared: dict[str, _Store] = {}
_shared_lock = threading.Lock()


class MemoryBackend(StorageBackend):
    """Dict of records with an optional byte capacity and LRU eviction.

    Extra config: `capacity_bytes` (0 = unbounded), `shared` (name of a process-wide store).
    """

    name: ClassVar[str] = "memory"

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        capacity = int(config.get("capacity_bytes", 0))
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
                s.data.move_to_end(k)
                dst = memoryview(buf).cast("B")
                if len(v) == len(dst):
                    dst[:] = v
                res.append(len(v))
        return res

    def batch_set(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]:
        s = self._store
        ok: list[bool] = []
        written = evicted = 0
        with s.lock:
            for k, v in zip(keys, values):
                b = bytes(memoryview(v).cast("B"))
                if s.capacity_bytes and len(b) > s.capacity_bytes:
                    ok.append(False)
                    continue
                old = s.data.pop(k, None)
                if old is not None:
                    s.bytes -= len(old)
                while s.capacity_bytes and s.bytes + len(b) > s.capacity_bytes and s.data:
                    _, dropped = s.data.popitem(last=False)
                    s.bytes -= len(dropped)
                    evicted += 1
                s.data[k] = b
                s.bytes += len(b)
                written += len(b)
                ok.append(True)
            pages, nbytes = len(s.data), s.bytes
        self._count(
            set_pages=len(keys),
            set_failures=ok.count(False),
            bytes_written=written,
            evicted_pages=evicted,
        )
        self._set_gauge(stored_pages=pages, stored_bytes=nbytes)
        return ok

    def delete(self, keys: Sequence[str]) -> None:
        s = self._store
        n = 0
        with s.lock:
            for k in keys:
                v = s.data.pop(k, None)
                if v is not None:
                    s.bytes -= len(v)
                    n += 1
            pages, nbytes = len(s.data), s.bytes
        self._count(deleted_pages=n)
        self._set_gauge(stored_pages=pages, stored_bytes=nbytes)

    def clear(self) -> None:
        s = self._store
        with s.lock:
            s.data.clear()
            s.bytes = 0
        self._set_gauge(stored_pages=0, stored_bytes=0)

    def raw_put(self, key: str, value: bytes) -> None:
        """Store `value` as-is, bypassing nothing but the caller's sense: for corruption tests."""
        s = self._store
        with s.lock:
            old = s.data.pop(key, None)
            if old is not None:
                s.bytes -= len(old)
            s.data[key] = value
            s.bytes += len(value)
