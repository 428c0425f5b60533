"""The client side of `hicache-server`'s shared-memory store (protocol v3 reads, v4 writes).

A same-host server keeps its memory tier in an arena in /dev/shm (`hicache_client.remote.
shm_files`). The client maps it (`map_store`) once, read-write, and then:

- reads in place (`locate_get`): `shm_locate` answers (offset, length, generation) per key; the
  client copies each record from its mapping into the caller's buffer and checks the generation
  did not change during the copy. One copy, made by the client; no page bytes on the socket.
- writes in place (`store_set`): `shm_reserve` answers an arena slot (offset, generation) per
  record; the client copies the record into it and `shm_commit` has the server store the slots
  (`storage_backends.server.reservations`). One copy, made by the client.

Whatever cannot go this way (no room in the arena, a record moved during its copy, an older
server) goes through the connection's region (`hicache_client.remote.shm`) or TCP frames.
`StoreAccess` is one backend's use of the store: the mapping, whether to use it, and counters.
A mapping fills its page tables for the part of the arena the server holds space for on a
background thread (`Populator`), so the hot path's copies do not fault page by page.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import mmap
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial

from hicache_client.errors import StorageError
from hicache_client.remote import protocol as P
from hicache_client.remote import shm_files as layout
from hicache_client.remote.shm import SHM_REFUSALS, Exchange, ShmLost, checked, split

logger = logging.getLogger(__name__)

STORE_NAME = re.compile(re.escape(layout.NAME_PREFIX) + r"[0-9]+-[0-9a-f]+")
# A record the client must read another way (`shm_get` or TCP): not in the arena, or changed
# while it was copied.
NOT_MAPPED = -2


_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in, writable, without touching their bytes
_POPULATE_STEP = 64 << 20  # bytes per madvise call (a close waits for one at most)


def _load_libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


_libc = _load_libc()


def mapping_address(mm: mmap.mmap) -> int:
    """Where `mm` is mapped in this process (the buffer export is let go at once)."""
    c = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(c)
    finally:
        del c


class Populator:
    """Fills this process's page tables for the part of the server's arena that has tmpfs
    space (the mark at `ALLOCATED_AT` in its header), on a background thread, as the mark
    grows. A first touch of a mapped page otherwise faults, one 4 KiB page at a time: about
    1 us each on a VM, several times the cost of copying the page, paid by the first copies of
    every client process. Never reaches past the mark, so the arena stays as sparse as the
    server keeps it. Off (`enabled` False) where `MADV_POPULATE_WRITE` is refused (Linux before
    5.14): pages then fault in as they are first touched, as before."""

    def __init__(self, mm: mmap.mmap, data_start: int, mark: memoryview) -> None:
        self._base = mapping_address(mm)
        self._mm = mm  # kept mapped while the thread runs
        self._start = data_start
        self._limit = len(mm) - data_start  # data bytes mapped
        self._mark = mark  # the server's mark (one u64 in the shared header)
        self.enabled = _libc is not None
        self.done = 0  # data bytes populated, from the data start
        self._seen = 0  # the mark last seen
        self._asked = 0  # populate up to here (the mark, within the mapping)
        self._stop = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def poke(self) -> None:
        """Populate up to the server's mark, if it moved (cheap: called per record)."""
        if self._mark[0] != self._seen and self.enabled:
            with self._lock:
                self._seen = int(self._mark[0])
                self._asked = max(self._asked, min(self._seen, self._limit))
                if self._thread is None and not self._stop:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name="hicache-store-populate")
                    self._thread.start()

    def _run(self) -> None:
        page = mmap.PAGESIZE
        while True:
            with self._lock:
                if self._stop or self.done >= self._asked:
                    self._thread = None
                    return
                n = min(self._asked - self.done, _POPULATE_STEP)
            n -= n % page
            assert _libc is not None
            rc = _libc.madvise(ctypes.c_void_p(self._base + self._start + self.done),
                               ctypes.c_size_t(n), _MADV_POPULATE_WRITE) if n else -1
            if rc != 0:
                logger.debug("hicache backend: not populating the store mapping: %s",
                             os.strerror(ctypes.get_errno()) if n else "below a page")
                with self._lock:
                    self.enabled = False
                    self._thread = None
                return
            self.done += n

    def stop(self) -> None:
        """Stop populating (waits for the madvise call in progress)."""
        with self._lock:
            self._stop = True
            thread = self._thread
        if thread is not None:
            thread.join()

    def wait(self, timeout: float) -> bool:
        """Whether the mapping is populated up to the mark last seen, waiting up to `timeout`
        seconds (tests)."""
        deadline = time.monotonic() + timeout
        while self.enabled and self.done < self._asked and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.done >= self._asked


class StoreMap:
    """The server's arena, mapped (`map_store`): records are copied from it in place, and
    written into slots the server reserved for this client (`store_set`).

    The file is checked like a region the other way round (a plain file in /dev/shm, ours, mode
    0600, of the stated size) and its header must name the arena id the server gave, so a file
    of another server (or another host's name) is never read or written."""

    def __init__(self, name: str, size: int, arena_id: int, *, populate: bool = True) -> None:
        if not STORE_NAME.fullmatch(name):
            raise StorageError(f"shared-memory store name {name!r} is not ours")
        path = os.path.join(layout.SHM_DIR, name)
        if size < layout.HEADER_BYTES:
            raise StorageError(f"a store of {size} bytes is smaller than its header")
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            problem = layout.private_file_problem(os.fstat(fd), size)
            if problem is not None:
                raise StorageError(f"{path} {problem}")
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mm)
        magic, aid, block, table, data = layout.HEADER.unpack_from(self.buf, 0)
        self.data_start = -(-(layout.HEADER_BYTES + table) // layout.BLOCK) * layout.BLOCK
        if (magic, aid, block) != (layout.MAGIC, arena_id, layout.BLOCK) \
                or self.data_start + data != size:
            self.close()
            raise StorageError(f"{path} is not the arena {arena_id} of the server")
        self.id = arena_id
        self.size = size
        self._gens = self.buf[layout.HEADER_BYTES : layout.HEADER_BYTES + table].cast("Q")
        self._mark = self.buf[layout.ALLOCATED_AT : layout.ALLOCATED_AT + 8].cast("Q")
        self.populator = Populator(self._mm, self.data_start, self._mark) if populate else None
        self._poke = self.populator.poke if self.populator is not None else _nothing
        self._poke()

    def _block(self, offset: int, length: int) -> int:
        """The first block of a record of `length` bytes at `offset`; -1 when that is not a
        record place in the data (not block-aligned, or outside)."""
        block, rem = divmod(offset - self.data_start, layout.BLOCK)
        if block < 0 or rem or not offset < offset + length <= self.size:
            return -1
        return block

    def read(self, offset: int, length: int, gen: int, dst: memoryview) -> bool:
        """Copy the record at `offset` into `dst` (exactly `length` bytes); False when the
        descriptor is outside the data, or the record was freed before or during the copy."""
        block = self._block(offset, length)
        if block < 0 or length != len(dst) or self._gens[block] != gen:
            return False
        self._poke()
        dst[:] = self.buf[offset : offset + length]
        return bool(self._gens[block] == gen)

    def view(self, offset: int, length: int, gen: int) -> memoryview | None:
        """The record at `offset` where it lies in the mapping, or None when the descriptor is
        outside the data or the record is no longer that one. Its bytes are the record's only
        while `current(offset, gen)` holds: copy them out, then ask."""
        block = self._block(offset, length)
        if block < 0 or self._gens[block] != gen:
            return None
        self._poke()
        return self.buf[offset : offset + length]

    def current(self, offset: int, gen: int) -> bool:
        """Whether the record at `offset` (a place `view` accepted) still has generation `gen`:
        it was not freed since (so not overwritten by another record)."""
        return bool(self._gens[(offset - self.data_start) // layout.BLOCK] == gen)

    def write(self, offset: int, gen: int, src: memoryview | Sequence[memoryview]) -> bool:
        """Copy `src` (one buffer, or a record's parts one after the other) into the slot
        reserved at `offset` with generation `gen`; False (nothing written) when the descriptor
        is outside the data or the slot is no longer that one (its reservation expired and the
        blocks may hold another record)."""
        parts = (src,) if isinstance(src, memoryview) else src
        length = sum(len(p) for p in parts)
        block = self._block(offset, length)
        if block < 0 or self._gens[block] != gen:
            return False
        self._poke()
        buf = self.buf
        for p in parts:
            n = len(p)
            buf[offset : offset + n] = p
            offset += n
        return True

    def fill(self, offset: int, gen: int, length: int,
             writer: Callable[[memoryview], None]) -> bool:
        """`write` by a callable: `writer(slot)` writes the record (exactly `length` bytes) into
        the slot itself (a sealed record is sealed straight into it: one pass)."""
        block = self._block(offset, length)
        if block < 0 or self._gens[block] != gen:
            return False
        self._poke()
        writer(self.buf[offset : offset + length])
        return True

    def close(self) -> None:
        populator = getattr(self, "populator", None)
        if populator is not None:
            populator.stop()
        with contextlib.suppress(AttributeError):
            self._gens.release()
            self._mark.release()
        self.buf.release()
        self._mm.close()


def _nothing() -> None:
    pass


def map_store(call: Callable[[P.Request], P.Reply], populate: bool = True) -> StoreMap | None:
    """Ask the server for its store and map it; None when it has none (or an older protocol).
    `populate`: fill the mapping's page tables ahead of use (`Populator`)."""
    reply = call(P.MapStoreRequest())
    if isinstance(reply, P.ErrorReply):
        if reply.code in SHM_REFUSALS:
            return None
        raise StorageError(f"server answered {reply.code}: {reply.message}")
    if not isinstance(reply, P.MapStoreReply):
        raise StorageError(f"server answered {reply.TYPE} to map_store")
    return StoreMap(reply.name, reply.size, reply.arena_id, populate=populate)


def store_set(
    exchange: Exchange,
    store: StoreMap,
    slots: dict[int, list[tuple[int, int, float]]],
    keys: Sequence[str],
    records: Sequence[Sequence[memoryview]],
    batch_keys: int,
    fill: Callable[[int, memoryview], None] | None = None,
) -> list[bool | None]:
    """Write `records[i]` (a record's parts, one after the other) straight into slots of the
    server's arena reserved for this connection, then have the server store them (one copy,
    made here): per key whether stored, None when no slot could be had (the caller sends that
    record another way).

    `slots` is the connection's stock of reservations by record length: (offset, generation,
    use-by time). A record takes one of its length; those lacking one are reserved first (a
    round trip); the commit reserves the same lengths again, so the next batch of alike records
    needs no reservation round trip. Raises `ShmLost` when the server's arena is not the one
    mapped, `ReserveRefused` when the server does not know `shm_reserve`. `fill(i, slot)`,
    when given, writes record i into its slot instead of copying `records[i]` (whose lengths
    still say the records' sizes)."""
    now = time.monotonic()
    res: list[bool | None] = [None] * len(keys)
    sizes = [sum(len(p) for p in parts) for parts in records]
    picks = [_take_slot(slots, n, now) for n in sizes]
    missing = [i for i, p in enumerate(picks) if p is None]
    if missing:
        lengths = [sizes[i] for i in missing]
        r = exchange([P.ShmReserveRequest(arena_id=store.id, lengths=lengths)], None)[0]
        if isinstance(r, P.ErrorReply) and r.code in (P.ErrorCode.UNKNOWN_TYPE,
                                                       P.ErrorCode.BAD_VERSION):
            raise ReserveRefused(f"{r.code}: {r.message}")
        checked(r, P.ShmReserveReply, len(missing))
        assert isinstance(r, P.ShmReserveReply)
        for i, off, gen in zip(missing, r.offsets, r.gens):
            if off >= 0:
                picks[i] = (off, gen)
    idx: list[int] = []  # records written, and where
    offsets: list[int] = []
    for i, p in enumerate(picks):
        if p is not None and (store.write(p[0], p[1], records[i]) if fill is None else
                              store.fill(p[0], p[1], sizes[i], partial(fill, i))):
            idx.append(i)
            offsets.append(p[0])
    chunks = split(len(idx), None, batch_keys, 0)
    again = [[sizes[idx[j]] for j in c] for c in chunks]
    reqs = [P.ShmCommitRequest(arena_id=store.id, keys=[keys[idx[j]] for j in c],
                               offsets=[offsets[j] for j in c], reserve=n)
            for c, n in zip(chunks, again)]
    for c, n, r in zip(chunks, again, exchange(reqs, None) if reqs else []):
        checked(r, P.ShmCommitReply, len(c))
        assert isinstance(r, P.ShmCommitReply)
        for j, stored in zip(c, r.stored):
            res[idx[j]] = stored is True
        if len(r.offsets) == len(n):
            # Used before half their time is up: the server's clock never runs out first.
            use_by = now + r.expires_ms / 2000
            for length, off, gen in zip(n, r.offsets, r.gens):
                if off >= 0:
                    slots.setdefault(length, []).append((off, gen, use_by))
    return res


def _take_slot(
    slots: dict[int, list[tuple[int, int, float]]], length: int, now: float
) -> tuple[int, int] | None:
    """A reserved slot for a record of `length` bytes (offset, generation), if one is held and
    still in time."""
    stock = slots.get(length)
    while stock:
        off, gen, use_by = stock.pop()
        if use_by > now:
            return off, gen
    return None


def locate(
    exchange: Exchange,
    store: StoreMap,
    keys: Sequence[str],
    batch_keys: int,
    take: Callable[[int, int, int, int], None],
) -> None:
    """Ask the server where `keys` are in its arena (`shm_locate`, pipelined); as each reply
    arrives, `take(i, offset, length, gen)` per key (length -1: absent; offset -1: present but
    not in the arena). Raises `ShmLost` when the server's arena is not the one mapped (it
    restarted). The server leases each record it locates to this connection (it is neither
    evicted nor reused meanwhile); once every `take` has run (the copies are over) the leases
    are released, with a request whose reply is not waited for."""
    chunks = split(len(keys), None, batch_keys, 0)  # by key count (a locate carries no bytes)
    leased: list[int] = []

    def located(i_req: int, r: P.Reply) -> None:
        c = chunks[i_req]
        checked(r, P.ShmLocateReply, len(c))
        assert isinstance(r, P.ShmLocateReply)
        if r.arena_id != store.id:
            raise ShmLost("the server's store is not the one mapped")
        leased.extend(off for off in r.offsets if off >= 0)
        for i, off, n, gen in zip(c, r.offsets, r.lengths, r.gens):
            take(i, off, n, gen)

    try:
        exchange([P.ShmLocateRequest(arena_id=store.id, keys=[keys[i] for i in c])
                  for c in chunks], located)
    finally:
        if leased:
            exchange([P.ShmReleaseRequest(arena_id=store.id, offsets=leased)], None)


def locate_get(
    exchange: Exchange,
    store: StoreMap,
    keys: Sequence[str],
    out: Sequence[memoryview],
    batch_keys: int,
    landed: Callable[[int, int], None] | None = None,
    take_view: Callable[[int, memoryview | None], None] | None = None,
) -> list[int]:
    """Read `keys` into `out` from the server's arena: per key the stored length (-1: absent;
    `NOT_MAPPED`: read it another way). `landed(i, length)` runs as each record is copied (its
    check then overlaps the next copies). Raises `ShmLost` when the server's arena is not the
    one mapped (it restarted). `take_view(i, record)`, when given, takes each record where it
    lies in the arena instead of a copy into `out[i]` (which then only sizes it), and is called
    again with None when the record changed meanwhile (what it took is void)."""
    res = [-1] * len(keys)

    def take(i: int, off: int, n: int, gen: int) -> None:
        if n < 0:
            res[i] = -1
        elif n != len(out[i]):
            res[i] = n  # the caller sees the wrong length: a miss, nothing copied
        elif take_view is not None:
            src = store.view(off, n, gen) if off >= 0 else None
            if src is not None:
                take_view(i, src)
                if not store.current(off, gen):
                    take_view(i, None)
                    src = None
            res[i] = n if src is not None else NOT_MAPPED
            if landed is not None and res[i] == n:
                landed(i, n)
        else:
            res[i] = n if off >= 0 and store.read(off, n, gen, out[i]) else NOT_MAPPED
            if landed is not None and res[i] == n:
                landed(i, n)

    locate(exchange, store, keys, batch_keys, take)
    return res


class ReserveRefused(Exception):
    """The server does not take writes into its store (an older protocol)."""


class StoreAccess:
    """One client's use of the server's store: mapped on first use (once; a refusal or a
    failure to map turns it off for good), written into until the server refuses reservations,
    and counted."""

    def __init__(self, wanted: bool, populate: bool = True) -> None:
        self.map: StoreMap | None = None
        self.populate = populate  # map the store's allocated part ahead of use
        self.wanted = wanted  # map the store when asked (False: no shm, or it cannot be used)
        self.writes_wanted = wanted  # write records into reserved slots
        self._lock = threading.Lock()
        self.reads = 0  # records copied in place from the store
        self.fallbacks = 0  # records located but read another way (not there, or moved)
        self.writes = 0  # records written in place into the store
        self.write_fallbacks = 0  # records sent another way (no slot reserved, or it moved)

    def mapped(self, call: Callable[[P.Request], P.Reply]) -> StoreMap | None:
        """The store, mapped (asked for once with `call`; None when the server has none or it
        cannot be mapped here, e.g. another host)."""
        store = self.map
        if store is not None or not self.wanted:
            return store
        with self._lock:
            if self.map is None and self.wanted:
                try:
                    self.map = map_store(call, self.populate)
                except (OSError, StorageError) as e:
                    logger.info("hicache backend: not using the server's store in place: %s", e)
                if self.map is None:
                    self.wanted = False
                else:
                    logger.info("hicache backend: reading and writing pages in place in the "
                                "server's store")
            return self.map

    def refused_writes(self, why: str) -> None:
        if self.writes_wanted:
            self.writes_wanted = False
            logger.info("hicache backend: the server takes no writes into its store (%s); "
                        "sets go through the region", why)

    def count(self, reads: int = 0, fallbacks: int = 0, writes: int = 0,
              write_fallbacks: int = 0) -> None:
        with self._lock:
            self.reads += reads
            self.fallbacks += fallbacks
            self.writes += writes
            self.write_fallbacks += write_fallbacks
