"""Arena slots that same-host clients write into: the one-copy set (`shm_reserve`, `shm_commit`).

A set through a client's region costs two copies: the client's into the region, the server's
out of it into the arena. With a reservation the client writes the record straight into the
arena (it maps the store read-write) and the server only publishes it:

1. `shm_reserve(lengths)`: the server takes a run of free blocks per record (as
   `Arena.reserve`, a fresh generation in the table) and answers offsets and generations.
   Reserved slots are not in the store's map: no reader is ever told where they are.
2. The client checks the generation is still the one it was given, copies the record in, and
   sends `shm_commit(keys, offsets)`: each slot is put in the store under its key. The same
   request reserves room for the next batch (`reserve`), so a client writing batch after batch
   makes one round trip per batch and the server copies nothing.

A reservation belongs to the connection that made it, for `TTL_S`. One that is not committed
by then (a client that died or stalled) is freed, and a late commit of it stores nothing; the
slot's generation changes when it is freed, so a client that looks before writing never writes
into blocks given to another record. (One that writes anyway only damages bytes that every
reader validates, XXH3 included.) A connection holds at most `per_conn_bytes` of arena
reserved (whole blocks).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

from storage_backends.server.arena import BLOCK, ArenaSlot, blocks_for

TTL_S = 30.0


class Reservations:
    """Reserved, not yet committed slots, per connection (the request thread's alone)."""

    def __init__(
        self,
        reserve: Callable[[int], ArenaSlot | None],
        free: Callable[[ArenaSlot], None],
        per_conn_bytes: int,
        ttl_s: float = TTL_S,
    ) -> None:
        self._reserve, self._free = reserve, free
        self.per_conn_bytes = per_conn_bytes
        self.ttl_s = ttl_s
        # connection -> offset -> slot; and every reservation in order of its deadline
        self._held: dict[bytes, dict[int, ArenaSlot]] = {}
        self._bytes: dict[bytes, int] = {}
        self._deadlines: deque[tuple[float, bytes, int, ArenaSlot]] = deque()
        self.counters = {"reserved_slots": 0, "reserve_expired": 0}

    def reserve(
        self, ident: bytes, lengths: Sequence[int], max_record: int
    ) -> list[ArenaSlot | None]:
        """A slot per record (None: no room, over this connection's share, or a length the
        store does not take)."""
        now = time.monotonic()
        self.expire(now)
        held = self._held.setdefault(ident, {})
        out: list[ArenaSlot | None] = []
        for n in lengths:
            used = self._bytes.get(ident, 0)
            slot = None
            if 0 < n <= max_record and used + blocks_for(n) * BLOCK <= self.per_conn_bytes:
                slot = self._reserve(n)
            if slot is not None:
                held[slot.offset] = slot
                self._bytes[ident] = used + slot.blocks * BLOCK
                self._deadlines.append((now + self.ttl_s, ident, slot.offset, slot))
                self.counters["reserved_slots"] += 1
            out.append(slot)
        if not held:
            del self._held[ident]
        return out

    def take(self, ident: bytes, offset: int) -> ArenaSlot | None:
        """The slot `ident` reserved at `offset`, now the caller's to store or free; None when
        there is none (never reserved, expired, or taken already)."""
        held = self._held.get(ident)
        if held is None or offset not in held:
            return None
        return self._forget(ident, offset)

    def drop(self, ident: bytes) -> int:
        """Free every reservation of a connection (it detached); the count."""
        offsets = list(self._held.get(ident, {}))
        for offset in offsets:
            self._free(self._forget(ident, offset))
        return len(offsets)

    def expire(self, now: float | None = None) -> int:
        """Free the reservations past their deadline; the count. (Entries of reservations
        already committed or dropped are discarded from the front as they are met.)"""
        now = time.monotonic() if now is None else now
        n = 0
        while self._deadlines:
            deadline, ident, offset, slot = self._deadlines[0]
            held = self._held.get(ident)
            live = held is not None and held.get(offset) is slot
            if live and deadline > now:
                break
            self._deadlines.popleft()
            if live:
                self._free(self._forget(ident, offset))
                self.counters["reserve_expired"] += 1
                n += 1
        return n

    def _forget(self, ident: bytes, offset: int) -> ArenaSlot:
        held = self._held[ident]
        slot = held.pop(offset)
        self._bytes[ident] -= slot.blocks * BLOCK
        if not held:
            del self._held[ident]
            del self._bytes[ident]
        self.counters["reserved_slots"] -= 1
        return slot

    @property
    def slots(self) -> int:
        return self.counters["reserved_slots"]
