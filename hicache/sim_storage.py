"""Simulated L3 and transfers: page bookkeeping with no bytes.

`SimStorage` is L3 presence only (which page keys are stored, with an optional LRU page capacity);
`SimTransfer` is the `Transfer` of simulated mode: it moves nothing and completes at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hicache.ops import BackupOp, PrefetchOp, Transfer

if TYPE_CHECKING:
    from hicache.transfer import Event, LayerDoneCounter


class SimStorage:
    """L3 presence only: which page keys are stored, with LRU eviction at `capacity_pages`
    (None: unbounded). Reads refresh a key's recency; `exists` does not."""

    def __init__(self, capacity_pages: int | None = None) -> None:
        if capacity_pages is not None and capacity_pages < 0:
            raise ValueError("capacity_pages must be >= 0 or None")
        self.capacity_pages = capacity_pages
        self.keys: OrderedDict[str, None] = OrderedDict()
        self.evicted_pages = 0

    def __len__(self) -> int:
        return len(self.keys)

    def exists(self, keys: Sequence[str]) -> int:
        for i, k in enumerate(keys):
            if k not in self.keys:
                return i
        return len(keys)

    def get(self, keys: Sequence[str]) -> int:
        for i, k in enumerate(keys):
            if k not in self.keys:
                return i
            self.keys.move_to_end(k)
        return len(keys)

    def put(self, keys: Sequence[str]) -> int:
        if self.capacity_pages == 0:
            return 0
        for k in keys:
            self.keys[k] = None
            self.keys.move_to_end(k)
        if self.capacity_pages is not None:
            while len(self.keys) > self.capacity_pages:
                self.keys.popitem(last=False)
                self.evicted_pages += 1
        return len(keys)

    def clear(self) -> None:
        self.keys.clear()


class SimTransfer(Transfer):
    """The `Transfer` of simulated mode: page bookkeeping only."""

    def __init__(self, storage: SimStorage | None) -> None:
        self.storage = storage

    def device_to_host(
        self, device_pages: Sequence[int], host_pages: Sequence[int], ready: Event | None = None
    ) -> None:
        return None

    def host_to_device(
        self, host_pages: Sequence[int], device_pages: Sequence[int], layerwise: bool = False
    ) -> LayerDoneCounter | None:
        return None

    def exists(self, keys: Sequence[str]) -> int:
        assert self.storage is not None
        return self.storage.exists(keys)

    def store(self, keys: Sequence[str], host_pages: Sequence[int], op: BackupOp) -> None:
        assert self.storage is not None
        n = self.storage.put(keys)
        op.written += n
        op.failed += len(keys) - n

    def fetch(self, keys: Sequence[str], host_pages: Sequence[int], op: PrefetchOp) -> bool:
        assert self.storage is not None
        n = self.storage.get(keys)
        op.completed += n
        return n == len(keys)
