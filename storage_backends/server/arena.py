"""The server's page store in shared memory: same-host clients read pages in place (one copy).

The arena is one file in /dev/shm (mode 0600, a random name) that the server and same-host
clients of the same user map (`map_store`). A page record that lives in the arena is an
`ArenaSlot`; a `shm_locate` request answers (offset, length, generation) per key and the client
copies the record straight from its mapping into the caller's buffer: no server-side copy, no
socket bytes. Writes go the other way: the server reserves a slot (`reserve`), the client copies
the record into it and commits it (`storage_backends.server.reservations`). Layout:

    [0, 64)                header: magic, arena id, block size, table bytes, data bytes,
                           then (at `ALLOCATED_AT`) the data bytes tmpfs space is reserved for
    [64, 64 + table)       generation table: one little-endian u64 per data block
    [data_start, size)     data blocks (4 KiB); a record takes a run of whole blocks

A slot's generation is a fresh value of a global counter, written to the table entry of its
first block when it is allocated, and again (a new value) when it is freed, before the blocks can
be handed out again. A client checks the entry after copying: an unchanged generation means the
slot was not freed during the copy (x86-64 keeps stores, and loads, in program order; other
machines do not enable the arena). The client validates every record it reads besides (magic,
length, key digest, XXH3 checksum), so even a missed race cannot serve wrong bytes.

Space: a sparse file, allocated from tmpfs (`posix_fallocate`) as the high-water mark grows, so
an arena sized like `--capacity` costs only what is stored. The header publishes that mark, so
a client can map the allocated part ahead of use (`hicache_client.remote.store.Populator`) without ever
allocating the rest. A record that finds no run of free
blocks (or no tmpfs space) stays in the server's heap like a page received over TCP, and is
read through the older paths (`shm_get`, TCP frames): the arena is an accelerator, never a
condition. Only the server's request thread allocates and frees, under the store's lock.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import mmap
import os
import platform
import re
import resource
import secrets
import struct

from hicache_client.remote.shm_files import (
    ALLOCATED_AT,
    BLOCK,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    NAME_PREFIX,
    SHM_DIR,
)

logger = logging.getLogger(__name__)

_CLEAR = 16  # bytes cleared at the start of every slot handed out
_STALE_NAME = re.compile(re.escape(NAME_PREFIX) + r"(\d+)-[0-9a-f]+")


def blocks_for(n: int) -> int:
    """Blocks a record of `n` bytes takes (at least one)."""
    return max(1, -(-n // BLOCK))


def supported() -> bool:
    """Whether readers may rely on the generation check (store and load order: x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class ArenaSlot:
    """A record stored in the arena: `length` bytes at `offset`, valid while `gen` is current."""

    __slots__ = ("offset", "length", "blocks", "gen")

    def __init__(self, offset: int, length: int, blocks: int, gen: int) -> None:
        self.offset = offset
        self.length = length
        self.blocks = blocks
        self.gen = gen  # 0 once freed

    def __len__(self) -> int:
        return self.length


class Extents:
    """Free runs of blocks: first fit, neighbours merged on free."""

    def __init__(self, blocks: int) -> None:
        self._starts: list[int] = [0] if blocks else []  # sorted
        self._len: dict[int, int] = {0: blocks} if blocks else {}
        self.free_blocks = blocks

    def take(self, n: int) -> int | None:
        """The first block of a run of `n` free blocks, now used; None when none is long enough."""
        for i, start in enumerate(self._starts):
            have = self._len[start]
            if have >= n:
                del self._len[start]
                if have > n:
                    self._starts[i] = start + n
                    self._len[start + n] = have - n
                else:
                    del self._starts[i]
                self.free_blocks -= n
                return start
        return None

    def give(self, start: int, n: int) -> None:
        """Return blocks [start, start + n) (merged with free neighbours)."""
        self.free_blocks += n
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == start + n:  # merge the next run
            n += self._len.pop(self._starts.pop(i))
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._len[prev] == start:  # merge into the previous run
                self._len[prev] += n
                return
        self._starts.insert(i, start)
        self._len[start] = n

    def runs(self) -> list[tuple[int, int]]:
        return [(s, self._len[s]) for s in self._starts]


def remove_stale(directory: str = SHM_DIR) -> int:
    """Unlink arenas left by servers of this user that died without cleaning up; the count."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        m = _STALE_NAME.fullmatch(name)
        if m is None:
            continue
        pid = int(m.group(1))
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid != os.geteuid():
                continue
            os.kill(pid, 0)
            continue  # its server is alive
        except ProcessLookupError:
            pass
        except OSError:
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed += 1
    if removed:
        logger.info("removed %d shared-memory arenas of dead servers", removed)
    return removed


class Arena:
    """The server's shared-memory arena of `size` bytes (data; the table is added to it)."""

    def __init__(self, size: int, directory: str = SHM_DIR) -> None:
        blocks = size // BLOCK
        if blocks < 1:
            raise ValueError(f"arena of {size} bytes holds no {BLOCK}-byte block")
        self.table_start = HEADER_BYTES
        self.data_start = -(-(HEADER_BYTES + blocks * 8) // BLOCK) * BLOCK  # the next block
        self.blocks = blocks
        self.size = self.data_start + blocks * BLOCK
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and self.size > limit:
            # A file past RLIMIT_FSIZE would raise SIGXFSZ (by default fatal) on ftruncate.
            raise ValueError(f"the file size limit (ulimit -f: {limit} bytes) is below it")
        remove_stale(directory)
        self.id = secrets.randbits(63) | 1
        self.name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
        self.path = os.path.join(directory, self.name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.path, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, self.size)
            os.posix_fallocate(fd, 0, self.data_start)  # header and table: never SIGBUS
            self._mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            self._unlink()
            raise
        self._fd = fd
        self.buf = memoryview(self._mm)
        self._gens = self.buf[self.table_start : self.table_start + blocks * 8].cast("Q")
        HEADER.pack_into(self.buf, 0, MAGIC, self.id, BLOCK, blocks * 8, blocks * BLOCK)
        self._free = Extents(blocks)
        self._allocated_to = 0  # tmpfs space is reserved for blocks [0, _allocated_to)
        self._gen = 0
        self.counters = {
            "arena_slots": 0,  # records in the arena now
            "arena_full": 0,  # records that found no room (kept in the heap)
            "arena_bytes": 0,  # record bytes in the arena now
        }
        logger.info("shared-memory store arena %s: %d bytes", self.path, blocks * BLOCK)

    @property
    def used_blocks(self) -> int:
        return self.blocks - self._free.free_blocks

    def _next_gen(self) -> int:
        self._gen += 1
        return self._gen

    def _reserve(self, end_block: int) -> bool:
        """tmpfs space for blocks below `end_block` (a write there can then never SIGBUS)."""
        if end_block <= self._allocated_to:
            return True
        # Grow in steps of at least 64 MiB (or to the end), so fallocate runs rarely.
        end = min(self.blocks, max(end_block, self._allocated_to + (64 << 20) // BLOCK))
        try:
            os.posix_fallocate(self._fd, self.data_start + self._allocated_to * BLOCK,
                               (end - self._allocated_to) * BLOCK)
        except OSError as e:
            try:  # at least what is asked for
                os.posix_fallocate(self._fd, self.data_start + self._allocated_to * BLOCK,
                                   (end_block - self._allocated_to) * BLOCK)
                end = end_block
            except OSError:
                logger.warning("shared-memory arena cannot grow (%s): records stay in the heap",
                               e.strerror)
                return False
        self._allocated_to = end
        struct.pack_into("<Q", self.buf, ALLOCATED_AT, end * BLOCK)
        return True

    def reserve(self, n: int) -> ArenaSlot | None:
        """A slot for a record of `n` bytes (its generation current, its bytes not written);
        None when no room."""
        blocks = blocks_for(n)
        start = self._free.take(blocks)
        if start is None or not self._reserve(start + blocks):
            if start is not None:
                self._free.give(start, blocks)
            self.counters["arena_full"] += 1
            return None
        gen = self._next_gen()
        self._gens[start] = gen
        off = self.data_start + start * BLOCK
        # The record that had these blocks before must not pass for the new one (a slot
        # committed unwritten): its first bytes (a record's magic) are cleared.
        self.buf[off : off + min(n, _CLEAR)] = bytes(min(n, _CLEAR))
        self.counters["arena_slots"] += 1
        self.counters["arena_bytes"] += n
        return ArenaSlot(off, n, blocks, gen)

    def store(self, record: memoryview) -> ArenaSlot | None:
        """A slot holding a copy of `record`; None when no room (the caller keeps its copy)."""
        slot = self.reserve(record.nbytes)
        if slot is not None:
            off = slot.offset
            self.buf[off : off + slot.length] = record.cast("B") if record.format != "B" else record
        return slot

    def view(self, slot: ArenaSlot) -> memoryview:
        """The record's bytes in the server's mapping (valid until the slot is freed)."""
        return self.buf[slot.offset : slot.offset + slot.length]

    def free(self, slot: ArenaSlot) -> None:
        """Give the slot's blocks back; readers still copying it see a new generation first."""
        if slot.gen == 0:
            return  # freed already
        start = (slot.offset - self.data_start) // BLOCK
        self._gens[start] = self._next_gen()
        slot.gen = 0
        self._free.give(start, slot.blocks)
        self.counters["arena_slots"] -= 1
        self.counters["arena_bytes"] -= slot.length

    def gen_of(self, offset: int) -> int:
        return int(self._gens[(offset - self.data_start) // BLOCK])

    def _unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        self._unlink()
        self._gens.release()
        self.buf.release()
        self._mm.close()
        os.close(self._fd)
