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
  those slots; with persistence, the write-behind queue gets a heap copy;
- records located for reads in place are leased to their reader (`storage_backends.server.
  admin`); pinned pages stay in memory (read back from disk at start-up) and leave the pin
  list when they are deleted or cleared.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

__all__ = ["PinLimit", "Tiers"]

from storage_backends.server.admin import NamespaceCounters, PinLimit, Pins, namespace_rows
from storage_backends.server.arena import BLOCK, Arena, ArenaSlot
from storage_backends.server.reservations import Reservations
from storage_backends.server.store import (
    _NS_END,
    PageStore,
    Value,
    WriteBehind,
    namespace_of,
    nbytes,
)
from storage_backends.server.tenants import TAG_CHARS

if TYPE_CHECKING:
    from storage_backends.server.cli import ServerConfig
    from storage_backends.server.metrics import Metrics

logger = logging.getLogger(__name__)


class Tiers:
    def __init__(self, config: ServerConfig, arena: Arena | None = None) -> None:
        self.config = config
        self.arena = arena
        self.store = PageStore(config.capacity_bytes, arena,
                               partition_chars=TAG_CHARS if config.tenants_file else 0)
        # One connection may hold at most a quarter of the arena reserved at a time.
        self.reservations = Reservations(
            self.store.reserve, self.store.free, (arena.blocks * BLOCK) // 4 if arena else 0
        )
        self.persist: WriteBehind | None = None
        self.metrics: Metrics | None = None  # set by the server once its metrics exist
        self.store.leases.ttl_s = config.read_lease_ms / 1000
        # Pinned pages are kept by both tiers, so they must fit the smaller one's share.
        caps = [c for c in (config.capacity_bytes,
                            config.persist_capacity_bytes if config.persist_dir else 0) if c]
        limit = int(config.pin_share * min(caps)) if caps else 1 << 62
        self.pins = self.store.pins = Pins(limit, config.persist_dir)
        self.namespaces = NamespaceCounters()
        self.partitions: dict[str, tuple[str, int]] = {}  # tag -> (name, max_bytes); tenants
        self.hits = self.misses = self.disk_hits = 0  # pages, either tier (`lookup`)
        self._disk_ns: dict[str, str] = {}  # persisted page name -> its namespace (a cache)
        if config.persist_dir:
            self.persist = WriteBehind(
                config.persist_dir,
                max_pending=config.persist_queue,
                capacity_bytes=config.persist_capacity_bytes,
            )
            # The disk tier's byte cap never evicts a pinned page's file.
            self.persist.backend.keep = self.pins.holds
            logger.info(
                "persistence at %s loaded %d pages (read into memory lazily, on first use)",
                config.persist_dir,
                self.persist.loaded_pages,
            )
        if len(self.pins):
            self._load_pinned()

    def _load_pinned(self) -> None:
        """Read the pinned pages back into memory (a restart); pins of pages gone are dropped."""
        keys = self.pins.keys()
        held = self.store.exists(keys)
        missing = [k for k, h in zip(keys, held) if not h]
        values = self.persist.get(missing) if self.persist is not None else [None] * len(missing)
        lost = [k for k, v in zip(missing, values)
                if v is None or not self._put_memory(k, v, persist=False)]
        if lost:
            self.pins.unpin(lost)
            logger.warning("dropped %d of %d pins: their pages are gone (first: %s)",
                           len(lost), len(keys), lost[0][:16])
        logger.info("%d pinned pages held (%d read back from disk)", len(self.pins),
                    sum(v is not None for v in values))

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

    def lookup(self, keys: list[str], ident: bytes | None = None) -> list[Value | None]:
        """The pages of `keys` (None: absent), memory first, then persistence (promoted).
        Counted as hits and misses, by namespace too (of connection `ident`)."""
        values = self.store.get(keys)
        hits = sum(v is not None for v in values)
        if hits < len(keys) and self.persist is not None:
            missing = [i for i, v in enumerate(values) if v is None]
            loaded = self.persist.get([keys[i] for i in missing])
            for i, v in zip(missing, loaded):
                if v is not None:
                    values[i] = v
                    self._put_memory(keys[i], v, persist=False)
            self.disk_hits += sum(v is not None for v in values) - hits
            hits = sum(v is not None for v in values)
        self.hits += hits
        self.misses += len(keys) - hits
        if self.metrics is not None:
            self.metrics.hits.inc(hits)
            self.metrics.misses.inc(len(keys) - hits)
        if ident is not None:
            view = self.store.view
            self.namespaces.count(ident, (namespace_of(view(v)[:_NS_END]) or "-"
                                          for v in values if v is not None), len(keys) - hits)
        return values

    def view(self, value: Value) -> memoryview:
        return self.store.view(value)

    def frame(self, value: Value) -> Any:
        """`value` as a buffer that outlives the request (a reply frame still being sent when
        the slot is freed must not change): an arena record is copied out."""
        return self.view(value).tobytes() if isinstance(value, ArenaSlot) else value

    def locate(self, keys: list[str], ident: bytes = b"") -> tuple[list[int], list[int],
                                                                    list[int]]:
        """Offsets, lengths (-1: absent) and generations of `keys` in the arena (offset -1: not
        in it, e.g. no room). Records found in the heap are moved into the arena first. Each
        record in the arena is leased to `ident` until it releases it or the lease expires."""
        offsets: list[int] = []
        lengths: list[int] = []
        gens: list[int] = []
        slots: list[Value] = []
        self.store.expire_leases()
        for key, v in zip(keys, self.lookup(keys, ident)):
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
                slots.append(v)
            else:
                offsets.append(-1)
                gens.append(0)
        self.store.lease(ident, slots)
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
        self.store.expire_leases()
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
        self.store.expire_leases()
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
        self.store.expire_leases()
        if len(self.pins) and (dropped := self.pins.unpin(keys)):
            logger.info("a delete of %d pages dropped %d pins", len(keys), dropped)
        n = self.store.delete(keys)
        if self.persist is not None:
            n = max(n, self.persist.delete(keys))
        return n

    def clear(self) -> None:
        self.pins.clear()
        self.namespaces.forget()
        self.store.clear()
        if self.persist is not None:
            self.persist.clear()

    def clear_namespace(self, namespace: bytes) -> int:
        """Drop every page whose record names `namespace`, in both tiers; how many (the larger
        of the two tiers' counts, as `delete`); its pins and counters go too."""
        ns = namespace.hex()
        if len(self.pins) and (dropped := self.pins.unpin(self.pinned_keys(ns))):
            logger.info("clearing namespace %s dropped %d pins", ns, dropped)
        self.namespaces.forget(ns)
        n = self.store.clear_namespace(namespace)
        if self.persist is not None:
            n = max(n, self.persist.clear_namespace(namespace))
        return n

    # -- the admin's -----------------------------------------------------------------------

    def admin_lookup(self, keys: list[str]) -> tuple[int, int, int]:
        """The leading run of `keys` held (either tier), the leading run in memory, and how
        many of the held run are pinned. No side effects (recency, counters)."""
        count = self.exists(keys)
        in_memory = 0
        for flag in self.store.exists(keys):
            if not flag:
                break
            in_memory += 1
        return count, in_memory, sum(self.pins.holds(k) for k in keys[:count])

    def pinned_bytes(self, keys: Any = None) -> int:
        keys = list(self.pins.keys() if keys is None else keys)
        return sum(n for n in self.store.sizes(keys) if n is not None)

    def pin(self, keys: list[str], ttl_ms: int, require_all: bool = False) -> tuple[int, int]:
        """Pin the pages of `keys` held (read into memory from disk first); (pinned, absent).
        `require_all`: none when any is absent. Raises `PinLimit`."""
        self.pins.expire()
        sizes = self.sizes(keys)
        if require_all and -1 in sizes:
            return 0, sizes.count(-1)
        on_disk = [k for k, n in zip(keys, sizes) if n >= 0 and k not in self.store]
        if on_disk and self.persist is not None:  # a pin keeps a page in memory: read it in
            for k, v in zip(on_disk, self.persist.get(on_disk)):
                if v is not None:
                    self._put_memory(k, v, persist=False)
        sizes = [-1 if n is None else n for n in self.store.sizes(keys)]
        pinned = self.pins.pin(keys, sizes, ttl_ms / 1000, self.pinned_bytes)
        if self.persist is not None:  # a pinned page is kept on disk too: write it if not there
            deadline = time.monotonic() + self.config.persist_block_ms / 1000.0
            for k, n in zip(keys, sizes):
                if n >= 0 and self.persist.size_of(k) is None:
                    (v,) = self.store.peek([k])
                    if v is not None:
                        self._persist(k, self.frame(v), deadline)
        return pinned, len(keys) - pinned

    def admin_clear(self, namespace: bytes | None) -> tuple[int, int]:
        """Clear one namespace, or (None) the whole server; (pages deleted, pins dropped)."""
        pins = len(self.pins)
        if namespace is not None:
            n = self.clear_namespace(namespace)
            return n, pins - len(self.pins)
        n = max(self.store.pages, self.persist.backend.stats().stored_pages
                if self.persist is not None else 0)
        self.clear()
        return n, pins

    def disk_namespaces(self) -> dict[str, tuple[int, int]]:
        """Per namespace (64 hex; "-": not a record), the pages and bytes on disk. Each file's
        header is read once (a key's namespace never changes); later calls walk the index."""
        if self.persist is None:
            return {}
        out: dict[str, tuple[int, int]] = {}
        cache = self._disk_ns
        seen: set[str] = set()
        for path, n in self.persist.backend.known_pages():
            ns = cache.get(path)
            if ns is None:
                try:
                    with open(path, "rb") as f:
                        ns = namespace_of(memoryview(f.read(_NS_END))) or "-"
                except OSError:
                    continue  # evicted or deleted meanwhile
                cache[path] = ns
            seen.add(path)
            pages, nbytes_ = out.get(ns, (0, 0))
            out[ns] = (pages + 1, nbytes_ + n)
        for path in [p for p in list(cache) if p not in seen]:
            cache.pop(path, None)
        return out

    def set_partitions(self, partitions: dict[str, tuple[str, int]]) -> None:
        """The tenants' partitions (tag -> (name, max_bytes)); a cap takes effect from the
        partition's next write (a lowered one evicts its pages as it writes, not at once)."""
        self.partitions = dict(partitions)
        self.store.quotas = {tag: cap for tag, (_, cap) in partitions.items() if cap}

    def pinned_keys(self, namespace: str | None = None, prefix: str = "") -> list[str]:
        """The pinned keys starting with `prefix` whose pages are held in memory as records of
        `namespace` (None: any)."""
        pinned = self.pins.keys()
        keys = [k for k in pinned if k.startswith(prefix)]
        return [k for k, ns in zip(keys, self.store.namespaces_of(keys))
                if ns is not None and namespace in (None, ns)]

    def namespace_rows(self) -> dict[str, dict[str, int]]:
        """The admin's `stats` rows: memory and disk pages, pins, hits and misses (the memory
        tier's from its running totals, the pins' from the pins alone: nothing walks every
        page)."""
        pinned: dict[str, tuple[int, int]] = {}
        for _, ns, n, _ in self.pin_list():
            if n >= 0:
                pages, nbytes_ = pinned.get(ns, (0, 0))
                pinned[ns] = (pages + 1, nbytes_ + n)
        return namespace_rows(self.store.namespace_totals(), pinned, self.namespaces,
                              self.disk_namespaces())

    def pin_list(self) -> list[tuple[str, str, int, int]]:
        """Every pin: (key, namespace, bytes (-1: not in memory), milliseconds left (-1: no
        lease))."""
        self.pins.expire()
        now = time.time()
        items = self.pins.items()
        keys = [k for k, _ in items]
        out: list[tuple[str, str, int, int]] = []
        for (key, until), ns, n in zip(items, self.store.namespaces_of(keys),
                                       self.store.sizes(keys)):
            out.append((key, ns or "-", -1 if n is None else n,
                        max(0, int((until - now) * 1000)) if until else -1))
        return out

    def stats(self) -> dict[str, int]:
        self.store.expire_leases()
        self.pins.expire()
        c = self.store.counters
        out = {
            "pages": self.store.pages,
            "bytes": self.store.bytes,
            "capacity_bytes": self.config.capacity_bytes,
            "hits": self.hits,  # either tier
            "misses": self.misses,  # neither tier
            "memory_hits": c.hits,
            "disk_hits": self.disk_hits,
            "evictions": c.evictions,
            "rejected": c.rejected,
            "quota_evictions": c.quota_evictions,
            "quota_rejected": c.quota_rejected,
            "pinned_pages": len(self.pins),
            "pinned_bytes": self.pinned_bytes(),
            "pin_limit_bytes": self.pins.limit_bytes,
            "pins_expired": self.pins.expired,
            "read_lease_held_slots": self.store.leases.deferred,
            **self.store.leases.counters,
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
