"""The server's two tiers behind one interface: memory (`PageStore`, optionally in a shared-memory
arena) and persistence (`WriteBehind`). Every request handler goes through here, so the rules
that tie the tiers together live in one place:

- a page is present when either tier has it (memory only after its persistence was dropped;
  disk only after an eviction or a restart); a persisted page read is promoted into memory;
- overwrites never go back in time: the older persisted copy is removed before a new value is
  acknowledged (a key whose old file stays is refused, keeping its old value everywhere);
- with an arena, records that shm clients send are stored in it (when persistence is off: the
  write-behind queue then holds no arena slot), and a record located by an shm client is moved
  into it, so every later read of it is one copy, made by the client;
- records that clients write into reserved arena slots (`reserve`, `commit`) are stored as
  those slots; with persistence, the write-behind queue gets a heap copy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from storage_backends.server.arena import BLOCK, Arena, ArenaSlot
from storage_backends.server.reservations import Reservations
from storage_backends.server.store import PageStore, Value, WriteBehind, nbytes

if TYPE_CHECKING:
    from storage_backends.server.cli import ServerConfig
    from storage_backends.server.metrics import Metrics

logger = logging.getLogger(__name__)


class Tiers:
    def __init__(self, config: ServerConfig, arena: Arena | None = None) -> None:
        self.config = config
        self.arena = arena
        self.store = PageStore(config.capacity_bytes, arena)
        # One connection may hold at most a quarter of the arena reserved at a time.
        self.reservations = Reservations(
            self.store.reserve, self.store.free, (arena.blocks * BLOCK) // 4 if arena else 0
        )
        self.persist: WriteBehind | None = None
        self.metrics: Metrics | None = None  # set by the server once its metrics exist
        if config.persist_dir:
            self.persist = WriteBehind(
                config.persist_dir,
                max_pending=config.persist_queue,
                capacity_bytes=config.persist_capacity_bytes,
            )
            logger.info(
                "persistence at %s loaded %d pages (read into memory lazily, on first use)",
                config.persist_dir,
                self.persist.loaded_pages,
            )

    def exists(self, keys: list[str]) -> int:
        """The length of the leading run of `keys` present in either tier."""
        flags = self.store.exists(keys)
        run = 0
        for key, in_memory in zip(keys, flags):
            if not in_memory and (self.persist is None or not self.persist.exists([key])[0]):
                break
            run += 1
        return run

    def sizes(self, keys: list[str]) -> list[int]:
        """Bytes of each page (-1: absent), no side effects."""
        sizes = self.store.sizes(keys)
        if self.persist is not None:
            sizes = [n if n is not None else self.persist.size_of(k) for k, n in zip(keys, sizes)]
        return [-1 if n is None else n for n in sizes]

    def lookup(self, keys: list[str]) -> list[Value | None]:
        """The pages of `keys` (None: absent), memory first, then persistence (promoted)."""
        values = self.store.get(keys)
        hits = sum(v is not None for v in values)
        if hits < len(keys) and self.persist is not None:
            missing = [i for i, v in enumerate(values) if v is None]
            loaded = self.persist.get([keys[i] for i in missing])
            for i, v in zip(missing, loaded):
                if v is not None:
                    values[i] = v
                    self._put_memory(keys[i], v, persist=False)
            hits = sum(v is not None for v in values)
        if self.metrics is not None:
            self.metrics.hits.inc(hits)
            self.metrics.misses.inc(len(keys) - hits)
        return values

    def view(self, value: Value) -> memoryview:
        return self.store.view(value)

    def frame(self, value: Value) -> Any:
        """`value` as a buffer that outlives the request (a reply frame still being sent when
        the slot is freed must not change): an arena record is copied out."""
        return self.view(value).tobytes() if isinstance(value, ArenaSlot) else value

    def locate(self, keys: list[str]) -> tuple[list[int], list[int], list[int]]:
        """Offsets, lengths (-1: absent) and generations of `keys` in the arena (offset -1: not
        in it, e.g. no room). Records found in the heap are moved into the arena first."""
        offsets: list[int] = []
        lengths: list[int] = []
        gens: list[int] = []
        for key, v in zip(keys, self.lookup(keys)):
            if v is None:
                offsets.append(-1)
                lengths.append(-1)
                gens.append(0)
                continue
            v = self.store.promote(key, v)
            lengths.append(nbytes(v))
            if isinstance(v, ArenaSlot):
                offsets.append(v.offset)
                gens.append(v.gen)
            else:
                offsets.append(-1)
                gens.append(0)
        return offsets, lengths, gens

    def _put_memory(
        self, key: str, value: Value, *, persist: bool, deadline: float = 0.0,
        to_arena: bool = False,
    ) -> bool:
        ok, evicted = self.store.put(key, value, to_arena=to_arena)
        self._evicted(evicted)
        if ok and persist and self.persist is not None:
            # The queue holds bytes that outlive the value (a slot is freed when evicted).
            self._persist(key, self.frame(value), deadline)
        return ok

    def _evicted(self, keys: list[str]) -> None:
        if keys:
            logger.debug("evicted %d pages", len(keys))
            if self.metrics is not None:
                self.metrics.evictions.inc(len(keys))

    def _persist(self, key: str, value: Value, deadline: float) -> None:
        assert self.persist is not None
        if not self.persist.enqueue(key, value, deadline) and self.metrics is not None:
            self.metrics.persist_dropped.inc()

    def set(self, keys: list[str], records: Sequence[Any], *, transient: bool) -> list[bool]:
        """Store `records[i]` under `keys[i]`; per key whether it was stored. `transient`: the
        records are views of a client's region, copied here (into the arena when there is one
        and no persistence; else into the heap)."""
        if transient and (self.arena is None or self.persist is not None):
            records = [memoryview(r).tobytes() for r in records]
            transient = False
        fresh = self.persist.supersede(keys) if self.persist is not None else [True] * len(keys)
        # One wait budget per request for room in a full write-behind queue (back pressure).
        deadline = time.monotonic() + self.config.persist_block_ms / 1000.0
        return [
            ok and self._put_memory(k, v, persist=True, deadline=deadline, to_arena=transient)
            for k, v, ok in zip(keys, records, fresh)
        ]

    def reserve(self, ident: bytes, lengths: list[int]) -> tuple[list[int], list[int]]:
        """Offsets and generations of arena slots reserved for `ident` to write records of
        `lengths` into (offset -1: none; the client sends that record another way)."""
        cap = self.config.max_frame_bytes
        if self.config.capacity_bytes:
            cap = min(cap, self.config.capacity_bytes)
        slots = self.reservations.reserve(ident, lengths, cap)
        return ([-1 if s is None else s.offset for s in slots],
                [0 if s is None else s.gen for s in slots])

    def commit(
        self, ident: bytes, keys: list[str], offsets: list[int]
    ) -> tuple[list[bool], int]:
        """Store the records `ident` wrote into its reservations: per key whether stored, and
        the bytes stored."""
        self.reservations.expire()
        found = [(i, s) for i, s in enumerate(self.reservations.take(ident, off)
                                               for off in offsets) if s is not None]
        names = [keys[i] for i, _ in found]
        fresh = self.persist.supersede(names) if self.persist is not None else [True] * len(found)
        deadline = time.monotonic() + self.config.persist_block_ms / 1000.0
        out = [False] * len(keys)
        for (i, slot), ok in zip(found, fresh):
            if ok:
                out[i] = self._put_memory(keys[i], slot, persist=True, deadline=deadline)
            else:
                self.store.free(slot)
        return out, sum(slot.length for i, slot in found if out[i])

    def delete(self, keys: list[str]) -> int:
        n = self.store.delete(keys)
        if self.persist is not None:
            n = max(n, self.persist.delete(keys))
        return n

    def clear(self) -> None:
        self.store.clear()
        if self.persist is not None:
            self.persist.clear()

    def clear_namespace(self, namespace: bytes) -> int:
        """Drop every page whose record names `namespace`, in both tiers; how many (the larger
        of the two tiers' counts, as `delete`)."""
        n = self.store.clear_namespace(namespace)
        if self.persist is not None:
            n = max(n, self.persist.clear_namespace(namespace))
        return n

    def stats(self) -> dict[str, int]:
        c = self.store.counters
        out = {
            "pages": self.store.pages,
            "bytes": self.store.bytes,
            "capacity_bytes": self.config.capacity_bytes,
            "hits": c.hits,
            "misses": c.misses,
            "evictions": c.evictions,
            "rejected": c.rejected,
        }
        if self.arena is not None:
            out.update(self.arena.counters)
            out.update(self.reservations.counters)
            out["arena_capacity_bytes"] = self.arena.blocks * BLOCK
        if self.persist is not None:
            out.update({f"persist_{k}": v for k, v in self.persist.counters().items()})
        return out

    def close(self) -> None:
        if self.persist is not None:
            n = self.persist.close()
            logger.info("persistence flushed (%d pages written)", n)
        self.store.clear()
        if self.arena is not None:
            self.arena.close()
