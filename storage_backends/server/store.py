"""The server's memory tier: opaque page records by key, a byte capacity, LRU eviction.

Large values are kept as the buffers they arrived in (a received `zmq.Frame`), so a stored page
is never copied on its way in or out; or, with a shared-memory arena, as `ArenaSlot`s that
same-host clients read in place (`storage_backends.server.arena`).
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import struct
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

from hicache.lru import LRUByteStore
from hicache_client.codec import RECORD_MAGIC
from storage_backends.server.admin import Pins, ReadLeases
from storage_backends.server.arena import Arena, ArenaSlot

# bytes, or any object with the buffer protocol and a byte length (a received zmq.Frame), or an
# ArenaSlot (len() is its length; its bytes are `PageStore.view(value)`). The write-behind queue
# never holds an ArenaSlot (a freed slot's bytes change), only `HeapValue`s.
HeapValue = Union[bytes, bytearray, memoryview, Any]
Value = Union[HeapValue, ArenaSlot]

logger = logging.getLogger(__name__)


def nbytes(value: Value) -> int:
    return value.nbytes if isinstance(value, memoryview) else len(value)


# Where a page record names its namespace (hicache_client.codec: magic 4s, version H, header_len H,
# then the 32-byte namespace seed), read by the namespace-scoped clear.
_NS_AT = struct.calcsize("<4sHH")
_NS_END = _NS_AT + 32


# A page record's magic, plain or sealed (hicache_client.remote.seal: the header stays
# readable, so a sealed record names its namespace the same way).
_MAGICS = (RECORD_MAGIC, b"HKVS")


def namespace_of(head: memoryview | bytes) -> str | None:
    """The namespace (64 hex) a page record names, or None for bytes that are not a record."""
    if len(head) < _NS_END or bytes(head[:4]) not in _MAGICS:
        return None
    return bytes(head[_NS_AT:_NS_END]).hex()


def in_namespace(head: memoryview | bytes, namespace: bytes) -> bool:
    """Whether the record starting with `head` is a page record of `namespace` (bytes that
    are not a record, or too short to be one, are in none)."""
    return (len(head) >= _NS_END and bytes(head[:4]) in _MAGICS
            and bytes(head[_NS_AT:_NS_END]) == namespace)


@dataclass
class StoreCounters:
    """Counters of the memory tier. Units are in the names."""

    hits: int = 0  # pages found by get
    misses: int = 0  # pages get did not find
    evictions: int = 0  # pages dropped to stay under the capacity
    rejected: int = 0  # pages refused because one is larger than the whole capacity
    quota_evictions: int = 0  # pages of a partition dropped to keep it under its max_bytes
    quota_rejected: int = 0  # pages refused: only the partition's kept pages are over its quota


class PageStore:
    """Thread-safe LRU map of key -> record with a byte capacity (0 = unbounded).

    `get` refreshes a page's recency, `exists` does not (a prefix probe is not a use).
    `set` of an existing key replaces it and makes it most recent. Eviction drops whole pages,
    least recently used first, until the new page fits. With an `arena`, every value dropped
    (evicted, replaced, deleted, cleared) that lives there gives its blocks back, once no read
    lease holds it (`leases`). Pinned pages (`pins`, set by the server) and leased ones are
    never evicted: a page that only their eviction would make room for is refused.
    """

    def __init__(self, capacity_bytes: int, arena: Arena | None = None,
                 partition_chars: int = 0) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.arena = arena
        self._lru: LRUByteStore[Value] = LRUByteStore(capacity_bytes, size=nbytes)
        self._lock = threading.Lock()
        # Pages and bytes held per (partition, namespace), kept as pages come and go so that a
        # metrics scrape or a tenant's `stats` never walks the map: the partition is a key's
        # first `partition_chars` characters (a tenant's tag; "" without tenants), the
        # namespace the one its record's header names, read once when it is stored (a
        # same-host client could rewrite an arena record in place later).
        self.partition_chars = partition_chars
        self._ns_of: dict[str, str] = {}
        self._totals: dict[tuple[str, str], list[int]] = {}
        # Per partition (tenants only): its bytes, its keys least recently used first, and
        # its byte quota (a tenant's `max_bytes`; the server sets `quotas` from the tenants
        # file). A page that would take a partition past its quota evicts that partition's
        # own least recently used pages first, never another's.
        self.quotas: dict[str, int] = {}
        self._part_bytes: dict[str, int] = {}
        self._order: dict[str, OrderedDict[str, None]] = {}
        self.counters = StoreCounters()
        self.pins: Pins | None = None
        self.leases = ReadLeases(arena.free if arena is not None else _no_free)

    def _keep(self, key: str, value: Value) -> bool:
        return (self.pins is not None and self.pins.holds(key)) or (
            isinstance(value, ArenaSlot) and self.leases.holds(value))

    @property
    def pages(self) -> int:
        return len(self._lru)

    @property
    def bytes(self) -> int:
        return self._lru.nbytes

    def __contains__(self, key: str) -> bool:
        return key in self._lru

    def view(self, value: Value) -> memoryview:
        """The bytes of a value held (an arena slot's only until it is dropped)."""
        if isinstance(value, ArenaSlot):
            assert self.arena is not None
            return self.arena.view(value)
        return value if isinstance(value, memoryview) else memoryview(value)

    def _count_in(self, key: str, value: Value) -> None:
        ns = sys.intern(namespace_of(self.view(value)[:_NS_END]) or "-")
        self._ns_of[key] = ns
        part = key[:self.partition_chars]
        row = self._totals.setdefault((part, ns), [0, 0])
        row[0] += 1
        row[1] += nbytes(value)
        if self.partition_chars:
            self._part_bytes[part] = self._part_bytes.get(part, 0) + nbytes(value)
            self._order.setdefault(part, OrderedDict())[key] = None

    def _count_out(self, key: str, value: Value) -> None:
        ns = self._ns_of.pop(key)
        part = key[:self.partition_chars]
        row = self._totals[(part, ns)]
        row[0] -= 1
        row[1] -= nbytes(value)
        if row[0] == 0:
            del self._totals[(part, ns)]
        if self.partition_chars:
            self._part_bytes[part] -= nbytes(value)
            order = self._order[part]
            del order[key]
            if not order:
                del self._order[part], self._part_bytes[part]

    def _quota_victims(self, key: str, size: int) -> list[str] | None:
        """The pages of `key`'s partition to evict so that a page of `size` bytes stored under
        `key` keeps the partition within its quota, least recently used first ([] when it
        fits or has no quota); None when it cannot (the page alone is larger than the quota,
        or only the partition's pinned or leased pages could make room)."""
        part = key[:self.partition_chars]
        quota = self.quotas.get(part, 0) if self.partition_chars else 0
        if not quota:
            return []
        if size > quota:
            return None
        order: OrderedDict[str, None] = self._order.get(part, OrderedDict())
        held = self._part_bytes.get(part, 0)
        if key in order:
            old = self._lru.get(key, touch=False)
            held -= nbytes(old) if old is not None else 0
        need = held + size - quota
        victims: list[str] = []
        for k in order:
            if need <= 0:
                break
            v = self._lru.get(k, touch=False)
            if k == key or v is None or self._keep(k, v):
                continue
            victims.append(k)
            need -= nbytes(v)
        return victims if need <= 0 else None

    def _reserving(self, key: str, keep: Any) -> Any:
        """`keep`, plus: when the partitions' quotas sum to at most the capacity, each quota
        is a reservation: another partition's page never evicts a capped partition's (which
        its quota keeps within its share; only its own pages evict each other)."""
        quotas = self.quotas
        if not quotas or not self.partition_chars or not self.capacity_bytes \
                or sum(quotas.values()) > self.capacity_bytes:
            return keep
        pc, mine = self.partition_chars, key[:self.partition_chars]

        def reserved(k: str, v: Value) -> bool:
            part = k[:pc]
            return (part != mine and part in quotas) or (keep is not None and keep(k, v))

        return reserved

    def partition_bytes(self, partition: str) -> int:
        """Bytes held in memory by one partition (a tenant's tag)."""
        with self._lock:
            return self._part_bytes.get(partition, 0)

    def _drop(self, values: Sequence[Value]) -> None:
        for v in values:
            if isinstance(v, ArenaSlot) and self.arena is not None \
                    and not self.leases.defer(v):
                self.arena.free(v)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [k in self._lru for k in keys]

    def get(self, keys: Sequence[str]) -> list[Value | None]:
        with self._lock:
            out = [self._lru.get(k) for k in keys]
            if self._order:
                pc = self.partition_chars
                for k, v in zip(keys, out):
                    if v is not None:
                        self._order[k[:pc]].move_to_end(k)
            hits = sum(v is not None for v in out)
            self.counters.hits += hits
            self.counters.misses += len(out) - hits
        return out

    def peek(self, keys: Sequence[str]) -> list[Value | None]:
        """Each page held (None: absent), without touching recency or counters."""
        with self._lock:
            return [self._lru.get(k, touch=False) for k in keys]

    def sizes(self, keys: Sequence[str]) -> list[int | None]:
        """Bytes of each page held (None: absent), without touching recency or counters."""
        return [None if v is None else nbytes(v) for v in self.peek(keys)]

    def put(self, key: str, value: Value, *, to_arena: bool = False) -> tuple[bool, list[str]]:
        """Store one page; returns (stored, keys evicted to make room). `to_arena`: `value` is
        a transient view (a client's region) whose bytes are copied, into the arena when it has
        room, else into the heap. An arena slot given and refused is freed."""
        with self._lock:
            size = nbytes(value)
            if self.capacity_bytes and size > self.capacity_bytes:
                self.counters.rejected += 1
                self._drop([value])
                return False, []
            victims = self._quota_victims(key, size)
            if victims is None:
                self.counters.quota_rejected += 1
                self._drop([value])
                return False, []
            quota_dropped = [(k, self._lru.pop(k)) for k in victims]
            for k, v in quota_dropped:
                assert v is not None
                self._count_out(k, v)
            self._drop([v for _, v in quota_dropped if v is not None])
            self.counters.quota_evictions += len(quota_dropped)
            old = self._lru.pop(key)
            keep = self._keep if self.pins or self.leases.counters["read_leases"] else None
            keep = self._reserving(key, keep)
            dropped = self._lru.make_room(size, keep)
            if dropped is None:  # only pinned or leased pages could make room: refused
                if old is not None:
                    self._lru.put(key, old)  # as before (it fitted then)
                self.counters.rejected += 1
                self._drop([value])
                return False, []
            for k, v in dropped:
                self._count_out(k, v)
            if old is not None:
                self._count_out(key, old)
            self._drop([v for _, v in dropped] + ([old] if old is not None else []))
            if to_arena:
                src = self.view(value)
                slot = self.arena.store(src) if self.arena is not None else None
                value = slot if slot is not None else src.tobytes()
            self._lru.put(key, value)
            self._count_in(key, value)
            self.counters.evictions += len(dropped)
        return True, victims + [k for k, _ in dropped]

    def reserve(self, n: int) -> ArenaSlot | None:
        """An arena slot for a record of `n` bytes that a client will write (not in the map
        until `put`); None without an arena or room."""
        with self._lock:
            return self.arena.reserve(n) if self.arena is not None else None

    def free(self, slot: ArenaSlot) -> None:
        """Give back a reserved slot that will not be stored."""
        with self._lock:
            self._drop([slot])

    def promote(self, key: str, value: Value) -> Value:
        """Move a heap value held under `key` into the arena (same recency); what is held now."""
        with self._lock:
            if self.arena is None or isinstance(value, ArenaSlot):
                return value
            if self._lru.get(key, touch=False) is not value:
                return value  # replaced or dropped meanwhile
            slot = self.arena.store(self.view(value))
            if slot is None:
                return value
            self._lru.replace(key, slot)
            return slot

    def delete(self, keys: Sequence[str]) -> int:
        with self._lock:
            dropped = [(k, v) for k, v in ((k, self._lru.pop(k)) for k in keys) if v is not None]
            for k, v in dropped:
                self._count_out(k, v)
            self._drop([v for _, v in dropped])
            return len(dropped)

    def clear(self) -> None:
        with self._lock:
            self._drop([self._lru[k] for k in self._lru])
            self._lru.clear()
            self._ns_of.clear()
            self._totals.clear()
            self._part_bytes.clear()
            self._order.clear()

    def clear_namespace(self, namespace: builtins.bytes | None, prefix: str = "") -> int:
        """Drop every record of `namespace` (named in its header; None: any) whose key starts
        with `prefix` (a tenant's partition); how many were dropped."""
        with self._lock:
            ns = None if namespace is None else namespace.hex()
            keys = [k for k, n in self._ns_of.items()
                    if k.startswith(prefix) and ns in (None, n)]
            dropped = [(k, self._lru.pop(k)) for k in keys]
            for k, v in dropped:
                assert v is not None
                self._count_out(k, v)
            self._drop([v for _, v in dropped if v is not None])
            return len(keys)

    def lease(self, ident: builtins.bytes, values: Sequence[Value | None]) -> None:
        """Lease the arena records among `values` to connection `ident` for reading."""
        with self._lock:
            for v in values:
                if isinstance(v, ArenaSlot) and v.gen:
                    self.leases.grant(ident, v)

    def release(self, ident: builtins.bytes, offsets: Sequence[int] | None = None) -> int:
        """End `ident`'s leases at `offsets` (None: all of them); then expire the overdue."""
        with self._lock:
            if offsets is None:
                n = self.leases.drop_conn(ident)
            else:
                n = self.leases.release(ident, offsets)
            self.leases.expire()
            return n

    def expire_leases(self) -> int:
        with self._lock:
            return self.leases.expire()

    def namespace_totals(self, partition: str | None = None) -> dict[str, tuple[int, int]]:
        """Namespace ("-": not a record) -> (pages, bytes) in memory; of one partition (a
        tenant's tag) only, unless None. Kept up to date as pages come and go: no walk."""
        out: dict[str, tuple[int, int]] = {}
        with self._lock:
            for (part, ns), (pages, nb) in self._totals.items():
                if partition is None or part == partition:
                    p0, b0 = out.get(ns, (0, 0))
                    out[ns] = (p0 + pages, b0 + nb)
        return out

    def namespaces_of(self, keys: Sequence[str]) -> list[str | None]:
        """The namespace each page's record named when it was stored (None: not held)."""
        with self._lock:
            return [self._ns_of.get(k) for k in keys]

    def lru_order(self) -> list[str]:
        """Keys from least to most recently used (for tests and debugging)."""
        with self._lock:
            return list(self._lru)


def _no_free(slot: ArenaSlot) -> None:
    raise AssertionError("no arena")


class WriteBehind:
    """Persistence of the memory tier to a directory, through the `file` backend.

    `enqueue` puts a page in a bounded pending map (latest value per key) and returns at once;
    one writer thread drains it in batches with `FileBackend.batch_set` (temp file + rename, so
    a crash never leaves half a record). When the map is full, `enqueue` waits until its
    `deadline` for room, then gives up: the page stays in memory only and is counted in
    `dropped`. Pages still pending when the process is killed are lost; `close()` (a clean
    shutdown) writes them all first.

    Reads look at pending and in-flight pages before the disk, so a page is never missed while
    it is on its way down. `delete` and `clear` cancel pending writes and run under the same
    I/O lock as the writer, so a deleted page is never written back afterwards.
    """

    def __init__(
        self,
        path: str,
        *,
        max_pending: int = 4096,
        capacity_bytes: int = 0,
        batch_pages: int = 64,
    ) -> None:
        from hicache_client.backend import StorageConfig
        from storage_backends.file_backend import FileBackend

        if max_pending < 1:
            raise ValueError(f"persist queue must hold at least 1 page, got {max_pending}")
        # Pages and pins.json are the tenants' data: the top folder is closed to others, so
        # nothing under it (files an older server left 0644 too) is reachable by another
        # user; hicache-server's main also sets a umask of 077 (files 0600, folders 0700).
        self.backend = FileBackend(
            StorageConfig(extra={"path": path, "capacity_bytes": capacity_bytes})
        )
        os.chmod(path, 0o700)
        self.max_pending = max_pending
        self.batch_pages = batch_pages
        self._pending: OrderedDict[str, HeapValue] = OrderedDict()
        self._inflight: dict[str, HeapValue] = {}
        self._cond = threading.Condition()
        self._io_lock = threading.Lock()  # held by the writer around each batch, and by delete
        self._closing = False
        self._written = 0
        self._dropped = 0
        self._failed = 0
        self._invalidate_failed = 0
        self.loaded_pages = max(0, self.backend.stats().stored_pages)
        self._thread = threading.Thread(target=self._run, name="hicache-persist", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        return len(self._pending) + len(self._inflight)

    def counters(self) -> dict[str, int]:
        with self._cond:
            return {
                "pending": len(self._pending) + len(self._inflight),
                "written": self._written,
                "dropped": self._dropped,
                "failed": self._failed,
                "invalidate_failed": self._invalidate_failed,
                "loaded": self.loaded_pages,
            }

    def enqueue(self, key: str, value: HeapValue, deadline: float) -> bool:
        """Queue `value` for writing; False (counted) when no room was free before `deadline`
        (a `time.monotonic()` value)."""
        with self._cond:
            if key in self._pending:
                self._pending[key] = value
                return True
            while len(self._pending) >= self.max_pending and not self._closing:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._dropped += 1
                    return False
                self._cond.wait(remaining)
            self._pending[key] = value
            self._cond.notify_all()
            return True

    def supersede(self, keys: Sequence[str]) -> list[bool]:
        """Make the persisted copies of `keys` unreadable; per key, whether that worked. Called
        before newer values of them are acknowledged, so that no read (after an eviction, a
        failed or skipped write, or a crash) can ever go back to an older value; a key whose
        old file could not be removed must be refused.

        Older values still queued are cancelled; when the writer is busy writing one of them, the
        call waits for that batch to land (so it cannot land after the delete); then the files
        are deleted. The new values are queued afterwards by `enqueue`: if that, or their write,
        fails, the keys are simply absent from disk (a miss, never a stale page)."""
        if not keys:
            return []
        with self._cond:
            for k in keys:
                self._pending.pop(k, None)
            busy = any(k in self._inflight for k in keys)
        if busy:
            with self._io_lock:  # the writer holds it for its whole batch
                pass
        try:
            self.backend.delete(keys)
        except OSError as e:
            logger.warning("invalidating %d persisted pages failed: %s", len(keys), e)
        out = [not self.backend.path_of(k).exists() for k in keys]
        if not all(out):
            self._invalidate_failed += out.count(False)
            logger.warning("%d older persisted pages could not be removed", out.count(False))
        return out

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending and self._closing:
                    return
            with self._io_lock:
                with self._cond:
                    batch: list[tuple[str, HeapValue]] = []
                    while self._pending and len(batch) < self.batch_pages:
                        batch.append(self._pending.popitem(last=False))
                    self._inflight.update(batch)
                    self._cond.notify_all()
                if not batch:
                    continue
                try:
                    ok = self.backend.batch_set(
                        [k for k, _ in batch], [memoryview(v) for _, v in batch]
                    )
                except Exception:  # noqa: BLE001 - the writer thread must never die
                    logger.exception("persisting %d pages failed", len(batch))
                    ok = [False] * len(batch)
                with self._cond:
                    self._inflight.clear()
                    self._written += sum(ok)
                    self._failed += len(ok) - sum(ok)
                    self._cond.notify_all()

    def _read(self, key: str) -> bytes | None:
        try:
            return self.backend.path_of(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning("reading persisted page %s failed: %s", key[:16], e)
            return None

    def get(self, keys: Sequence[str]) -> list[HeapValue | None]:
        out: list[HeapValue | None] = []
        for k in keys:
            with self._cond:
                v = self._pending.get(k)
                if v is None:
                    v = self._inflight.get(k)
            out.append(v if v is not None else self._read(k))
        return out

    def size_of(self, key: str) -> int | None:
        """Bytes `get([key])` would return (None: absent), without reading the page."""
        with self._cond:
            v = self._pending.get(key)
            if v is None:
                v = self._inflight.get(key)
        if v is not None:
            return nbytes(v)
        try:
            return os.stat(self.backend.path_of(key)).st_size
        except OSError:
            return None

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Presence per key, stopping at the first absent one (the rest are reported False)."""
        out = [False] * len(keys)
        for i, k in enumerate(keys):
            with self._cond:
                queued = k in self._pending or k in self._inflight
            if not queued and not self.backend.path_of(k).exists():
                break
            out[i] = True
        return out

    def delete(self, keys: Sequence[str]) -> int:
        with self._io_lock:
            with self._cond:
                n = sum(self._pending.pop(k, None) is not None for k in keys)
            on_disk = [k for k in keys if self.backend.path_of(k).exists()]
            self.backend.delete(on_disk)
        return max(n, len(on_disk))

    def clear(self) -> None:
        with self._io_lock:
            with self._cond:
                self._pending.clear()
            self.backend.clear()

    def clear_namespace(self, namespace: bytes | None, prefix: str = "") -> int:
        """Drop every page of `namespace` (None: any) whose key starts with `prefix`, queued or
        on disk (each file's header is read); how many. Runs under the writer's I/O lock, so
        none of them is written back afterwards. (A `prefix` finds only files named by their
        key: a tenant's stored keys always are, `tenants.Tenant.key`.)"""
        with self._io_lock:
            with self._cond:
                queued = [k for k, v in self._pending.items() if k.startswith(prefix) and (
                    namespace is None or in_namespace(memoryview(v)[:_NS_END], namespace))]
                for k in queued:
                    del self._pending[k]
            from storage_backends.file_backend import page_name

            names, hashed = [], 0
            for path in self.backend.root.glob(f"{prefix[:2]}*/{prefix[2:4]}*/{prefix}*"):
                if not path.is_file() or path.name.endswith(".tmp"):
                    continue
                if namespace is not None:
                    try:
                        with open(path, "rb") as f:
                            head = f.read(_NS_END)
                    except OSError:
                        continue  # vanished meanwhile
                    if not in_namespace(head, namespace):
                        continue
                if page_name(path.name) == path.name:  # named by its key: the backend's delete
                    names.append(path.name)
                else:  # named by its key's hash (a key that is not hex): no key to give
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                        hashed += 1
            self.backend.delete(names)
        return len(set(queued) | set(names)) + hashed

    def flush(self) -> None:
        """Wait until every queued page is written."""
        with self._cond:
            while self._pending or self._inflight:
                self._cond.wait(0.1)

    def close(self) -> int:
        """Flush, stop the writer, return the number of pages written over the object's life."""
        self.flush()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        self.backend.close()
        return self._written

