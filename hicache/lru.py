"""`LRUByteStore`: values under string keys within a byte capacity, least recently used evicted.

Used by the `memory` backend (hicache.memory_backend) and hicache-server's memory tier
(storage_backends/server/store.py). Not thread-safe: callers hold their own lock around a
sequence of calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sized
from typing import Generic, TypeVar

V = TypeVar("V", bound=Sized)


class LRUByteStore(Generic[V]):
    """Keys in least- to most-recently-used order; the bytes of a value are `len(value)`.

    `capacity_bytes` 0 means unbounded. `put` evicts from the LRU end until the new value fits
    and refuses (returns None) a value larger than the whole capacity.
    """

    def __init__(self, capacity_bytes: int = 0, size: Callable[[V], int] = len) -> None:
        """`size(value)`: the bytes a value takes (`len` by default; a store of memoryviews
        passes one that reads `.nbytes`)."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._size = size
        self._data: OrderedDict[str, V] = OrderedDict()
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of all values held."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[str]:
        """Keys, least recently used first."""
        return iter(self._data)

    def __getitem__(self, key: str) -> V:
        """The value of `key` without touching its recency; KeyError when absent."""
        return self._data[key]

    def __setitem__(self, key: str, value: V) -> None:
        """`put`, for a value that fits (ValueError otherwise)."""
        if self.put(key, value) is None:
            raise ValueError(
                f"{self._size(value)} bytes exceed the capacity {self.capacity_bytes}"
            )

    def get(self, key: str, *, touch: bool = True) -> V | None:
        """The value of `key` (None when absent); `touch` makes it the most recently used."""
        v = self._data.get(key)
        if v is not None and touch:
            self._data.move_to_end(key)
        return v

    def put(self, key: str, value: V) -> list[tuple[str, V]] | None:
        """Store `value` as the most recently used; return the entries evicted to make room,
        or None (nothing changed) when `value` alone exceeds the capacity."""
        size = self._size(value)
        if self.capacity_bytes and size > self.capacity_bytes:
            return None
        self.pop(key)
        evicted = self.make_room(size)
        assert evicted is not None
        self._data[key] = value
        self._bytes += size
        return evicted

    def make_room(
        self, size: int, keep: Callable[[str, V], bool] | None = None
    ) -> list[tuple[str, V]] | None:
        """Evict from the LRU end until `size` more bytes fit; the entries evicted, or None
        (nothing evicted) when `size` exceeds the whole capacity. `keep(key, value)`: entries
        never to evict (pinned, being read); each one met is made the most recently used, and
        when the others cannot free enough, nothing is evicted and None is returned."""
        if self.capacity_bytes and size > self.capacity_bytes:
            return None
        if keep is not None:
            return self._make_room_keeping(size, keep)
        evicted: list[tuple[str, V]] = []
        while self.capacity_bytes and self._bytes + size > self.capacity_bytes:
            k, v = self._data.popitem(last=False)
            self._bytes -= self._size(v)
            evicted.append((k, v))
        return evicted

    def _make_room_keeping(
        self, size: int, keep: Callable[[str, V], bool]
    ) -> list[tuple[str, V]] | None:
        need = self._bytes + size - self.capacity_bytes
        if not self.capacity_bytes or need <= 0:
            return []
        victims: list[str] = []
        kept: list[str] = []
        for k, v in self._data.items():  # least recently used first
            if keep(k, v):
                kept.append(k)
                continue
            victims.append(k)
            need -= self._size(v)
            if need <= 0:
                break
        if need > 0:
            return None
        for k in kept:  # met at the LRU end: moved away, so later evictions skip them fast
            self._data.move_to_end(k)
        evicted = [(k, self._data.pop(k)) for k in victims]
        self._bytes -= sum(self._size(v) for _, v in evicted)
        return evicted

    def replace(self, key: str, value: V) -> None:
        """Swap the value of `key` for one of the same size, keeping its recency (KeyError when
        absent, ValueError when the sizes differ)."""
        old = self._data[key]
        if self._size(old) != self._size(value):
            raise ValueError(f"replacement of {key!r} changes its size")
        self._data[key] = value

    def pop(self, key: str) -> V | None:
        """Remove `key`; its value, or None when absent."""
        v = self._data.pop(key, None)
        if v is not None:
            self._bytes -= self._size(v)
        return v

    def clear(self) -> None:
        self._data.clear()
        self._bytes = 0
