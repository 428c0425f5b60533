"""Operating the shared store: pins, read leases and per-namespace accounting.

- **Pins** (`Pins`, the admin's `pin` / `unpin`): a pinned page is never evicted by capacity
  pressure (`PageStore` skips it). A pin may carry a lease (a TTL): it ends on its own. Pins
  are bounded: the pinned pages together hold at most `limit_bytes` (`--pin-share` of
  `--capacity`, or of `--persist-capacity` when that is smaller); a pin past it is refused
  whole. With persistence the disk tier's byte cap never evicts a pinned page's file either
  (a page written while only pinned files could make room is not persisted). With `--persist-dir` they are kept in
  `pins.json` there (rewritten, atomically, on every change) and come back with the store
  after a restart: the pinned pages are read back into memory at start-up.
- **Read leases** (`ReadLeases`, the data path): a record located in the shared-memory store
  for a read in place (`shm_locate`) is leased to that connection until it sends `shm_release`
  for it, detaches, or the lease expires (`--read-lease-ms`, 10 s by default, Mooncake's
  anchor). A leased record is never evicted; one deleted, cleared or overwritten meanwhile
  leaves the store's map at once (later reads miss, or see the new value) but its blocks are
  freed only when its last lease ends, so the bytes a reader is copying are never reused.
- **Namespaces** (`NamespaceCounters`): hits (memory or disk) by the namespace their record
  names, misses by the namespace the connection declared (`bind_namespace`), for the admin's
  `stats`; pages and bytes per namespace in memory and on disk (`namespace_rows`).

Everything here belongs to the server's request thread (no locks of its own).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from storage_backends.server.arena import ArenaSlot

logger = logging.getLogger(__name__)

PINS_FILE = "pins.json"
DEFAULT_PIN_SHARE = 0.5
DEFAULT_READ_LEASE_MS = 10_000
UNBOUND = "-"  # the namespace row of misses on connections that declared none


class PinLimit(Exception):
    """A pin that would take the pinned bytes past the limit."""


class Pins:
    """Pinned keys and the wall-clock time each pin ends (0: no lease)."""

    def __init__(self, limit_bytes: int, directory: str | None = None) -> None:
        self.limit_bytes = limit_bytes
        self.path = Path(directory) / PINS_FILE if directory else None
        self._until: dict[str, float] = {}
        self.expired = 0  # pins whose lease ended
        if self.path is not None and self.path.exists():
            try:
                data = json.loads(self.path.read_text())
                self._until = {str(k): float(v) for k, v in data["pins"].items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                logger.warning("ignoring unreadable pins file %s: %s", self.path, e)
        self.expire()

    def __len__(self) -> int:
        return len(self._until)

    def keys(self) -> list[str]:
        return list(self._until)

    def items(self) -> list[tuple[str, float]]:
        """(key, wall-clock end of its lease; 0: none) of every pin."""
        return list(self._until.items())

    def holds(self, key: str, now: float | None = None) -> bool:
        """Whether `key` is pinned now (a lease that ended does not hold)."""
        until = self._until.get(key)
        if until is None:
            return False
        return until == 0 or until > (time.time() if now is None else now)

    def expire(self, now: float | None = None) -> list[str]:
        """Drop the pins whose lease ended; their keys."""
        now = time.time() if now is None else now
        gone = [k for k, u in self._until.items() if u and u <= now]
        for k in gone:
            del self._until[k]
        if gone:
            self.expired += len(gone)
            logger.info("%d pins' leases ended (first: %s); their pages may be evicted now",
                        len(gone), gone[0][:16])
            self._save()
        return gone

    def pin(self, keys: list[str], sizes: list[int], ttl_s: float,
            pinned_bytes: Callable[[Iterable[str]], int]) -> int:
        """Pin the present ones of `keys` (`sizes[i]` -1: absent, not pinned), for `ttl_s`
        seconds (0: until unpinned); how many were pinned. `pinned_bytes(keys)`: the bytes the
        present pages of `keys` hold. Raises `PinLimit` (nothing pinned) past the limit."""
        present = [k for k, n in zip(keys, sizes) if n >= 0]
        total = pinned_bytes(set(self._until) | set(present))
        if total > self.limit_bytes:
            raise PinLimit(
                f"pinning {len(present)} pages would pin {total} bytes in all; the limit is "
                f"{self.limit_bytes} bytes (--pin-share of --capacity, or of "
                "--persist-capacity when smaller): unpin others first")
        until = time.time() + ttl_s if ttl_s > 0 else 0.0
        for k in present:
            self._until[k] = until
        if present:
            self._save()
        return len(present)

    def unpin(self, keys: Iterable[str]) -> int:
        n = sum(self._until.pop(k, None) is not None for k in keys)
        if n:
            self._save()
        return n

    def clear(self) -> int:
        n = len(self._until)
        self._until.clear()
        self._save()
        return n

    def _save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({"pins": self._until}))
            os.replace(tmp, self.path)
        except OSError as e:
            logger.warning("cannot save pins to %s: %s", self.path, e)


@dataclass
class _Lease:
    slot: ArenaSlot
    count: int = 0
    dropped: bool = False  # no longer in the store's map: free it when the last lease ends


@dataclass
class ReadLeases:
    """Leases on arena slots located for reads in place. `free(slot)` gives a slot's blocks
    back (called here for a dropped slot when its last lease ends)."""

    free: Callable[[ArenaSlot], None]
    ttl_s: float = DEFAULT_READ_LEASE_MS / 1000
    _by_offset: dict[int, _Lease] = field(default_factory=dict)
    # connection -> offset -> deadlines of its grants, oldest first
    _conns: dict[bytes, dict[int, deque[float]]] = field(default_factory=dict)
    _deadlines: deque[tuple[float, bytes, int]] = field(default_factory=deque)
    counters: dict[str, int] = field(default_factory=lambda: {
        "read_leases": 0, "read_leases_released": 0, "read_leases_expired": 0,
        "read_lease_deferred_frees": 0})

    def holds(self, slot: ArenaSlot) -> bool:
        lease = self._by_offset.get(slot.offset)
        return lease is not None and lease.slot is slot

    @property
    def deferred(self) -> int:
        """Slots out of the store's map, kept for their readers."""
        return sum(lease.dropped for lease in self._by_offset.values())

    def grant(self, ident: bytes, slot: ArenaSlot, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        lease = self._by_offset.get(slot.offset)
        if lease is None or lease.slot is not slot:
            lease = self._by_offset[slot.offset] = _Lease(slot)
        lease.count += 1
        deadline = now + self.ttl_s
        self._conns.setdefault(ident, {}).setdefault(slot.offset, deque()).append(deadline)
        self._deadlines.append((deadline, ident, slot.offset))
        self.counters["read_leases"] += 1

    def defer(self, slot: ArenaSlot) -> bool:
        """Called when `slot` leaves the store's map: True when a lease holds it (its blocks
        are freed when the last lease ends), False when it may be freed now."""
        if not self.holds(slot):
            return False
        lease = self._by_offset[slot.offset]
        if not lease.dropped:
            lease.dropped = True
            self.counters["read_lease_deferred_frees"] += 1
        return True

    def release(self, ident: bytes, offsets: Iterable[int]) -> int:
        """End one lease of `ident` per offset (the read is over); how many ended."""
        n = 0
        held = self._conns.get(ident)
        for off in offsets:
            grants = held.get(off) if held is not None else None
            if grants:
                grants.popleft()
                self._end(ident, off)
                n += 1
        self.counters["read_leases_released"] += n
        return n

    def drop_conn(self, ident: bytes) -> int:
        """End every lease of a connection (it detached); how many."""
        held = self._conns.get(ident, {})
        n = 0
        for off, grants in list(held.items()):
            while grants:
                grants.popleft()
                self._end(ident, off)
                n += 1
        return n

    def expire(self, now: float | None = None) -> int:
        """End the leases past their deadline; how many."""
        now = time.monotonic() if now is None else now
        n = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, ident, off = self._deadlines.popleft()
            grants = self._conns.get(ident, {}).get(off)
            # Grants of one (connection, slot) end in order: the oldest left is this one,
            # unless it was released already (then the oldest left is a later grant).
            if grants and grants[0] <= deadline:
                grants.popleft()
                self._end(ident, off)
                n += 1
        self.counters["read_leases_expired"] += n
        return n

    def _end(self, ident: bytes, off: int) -> None:
        held = self._conns[ident]
        if not held[off]:
            del held[off]
            if not held:
                del self._conns[ident]
        self.counters["read_leases"] -= 1
        lease = self._by_offset[off]
        lease.count -= 1
        if lease.count == 0:
            del self._by_offset[off]
            if lease.dropped:
                self.free(lease.slot)


MAX_BOUND = 1 << 16  # connections whose bind_namespace is kept (as hello nonces)
MAX_MISS_ROWS = 1024  # namespaces with a misses row; later ones count under OTHER
OTHER = "other"


@dataclass
class NamespaceCounters:
    """Hits and misses per namespace (64-hex), and the namespace each connection declared."""

    hits: dict[str, int] = field(default_factory=dict)
    misses: dict[str, int] = field(default_factory=dict)
    bound: dict[bytes, str] = field(default_factory=dict)

    def bind(self, ident: bytes, namespace: str) -> None:
        """Connection `ident` declares its namespace; the oldest of more than `MAX_BOUND`
        declarations is forgotten (a connection that went away never says so)."""
        self.bound.pop(ident, None)
        self.bound[ident] = namespace
        while len(self.bound) > MAX_BOUND:
            del self.bound[next(iter(self.bound))]

    def count(self, ident: bytes, hit_namespaces: Iterable[str], misses: int) -> None:
        for ns in hit_namespaces:
            self.hits[ns] = self.hits.get(ns, 0) + 1
        if misses:
            ns = self.bound.get(ident, UNBOUND)
            if ns not in self.misses and len(self.misses) >= MAX_MISS_ROWS:
                ns = OTHER  # a declared namespace is only a client's word: rows stay bounded
            self.misses[ns] = self.misses.get(ns, 0) + misses

    def forget(self, namespace: str | None = None) -> None:
        """Drop the counters of one namespace (cleared), or of all."""
        if namespace is None:
            self.hits.clear()
            self.misses.clear()
        else:
            self.hits.pop(namespace, None)
            self.misses.pop(namespace, None)


def namespace_rows(
    memory: dict[str, tuple[int, int]], pinned: dict[str, tuple[int, int]],
    counters: NamespaceCounters, disk: dict[str, tuple[int, int]] | None = None,
) -> dict[str, dict[str, int]]:
    """Per namespace: pages, bytes (in memory), disk pages and bytes, pinned pages and bytes,
    hits (either tier), misses. Each of `memory`, `pinned` and `disk` maps a namespace to its
    (pages, bytes) in that place."""
    rows: dict[str, dict[str, int]] = {}

    def row(ns: str) -> dict[str, int]:
        r = rows.get(ns)
        if r is None:
            r = rows[ns] = {"pages": 0, "bytes": 0, "disk_pages": 0, "disk_bytes": 0,
                            "pinned_pages": 0, "pinned_bytes": 0, "hits": 0, "misses": 0}
        return r

    for prefix, table in (("", memory), ("disk_", disk or {}), ("pinned_", pinned)):
        for ns, (pages, nbytes) in table.items():
            r = row(ns)
            r[prefix + "pages"], r[prefix + "bytes"] = pages, nbytes
    for ns, n in list(counters.hits.items()):
        row(ns)["hits"] = n
    for ns, n in list(counters.misses.items()):
        row(ns)["misses"] = n
    return rows
