"""The server side of the same-host shared-memory data path (protocol version 2).

A client on the same host creates a file in /dev/shm (mode 0600, a random name), maps it, and
offers it with `attach_shm`. The server opens and maps it too: that it can open it proves the
client is on the same host and runs as the same user. From then on that connection's page
bytes go through the region instead of TCP frames: `shm_set` names (key, offset, length) of
records the client wrote there, which the server copies into its store (one memcpy); `shm_get`
names (key, offset, capacity) slots, which the server fills from its store (one memcpy).

Every descriptor from the client is checked against the region's size before any byte is read
or written; a bad one gets an error reply for the whole request and touches nothing. The file's
size is checked again (`fstat`) before each request, so a client that shrinks its file gets an
error instead of crashing the server with SIGBUS.

Attachments are kept per connection (ZeroMQ routing id), at most `max_bytes` mapped in total:
beyond it the least recently used attachment is dropped (its client gets `no_shm` and
attaches again or falls back to TCP). A client detaches when it closes (`detach_shm`).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from hicache_client.remote import protocol as P
from hicache_client.remote.shm_files import SHM_DIR, private_file_problem

logger = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")


def _refuse(message: str, rid: int) -> P.ProtocolError:
    return P.ProtocolError(P.ErrorCode.NO_SHM, message, rid)


class Region:
    """One client's mapped region."""

    def __init__(self, name: str, size: int, rid: int, forbidden: frozenset[tuple[int, int]] = frozenset(),
                 owner: str = "") -> None:
        if not _NAME.fullmatch(name) or name.startswith("."):
            raise _refuse(f"shm name {name!r} is not a plain file name", rid)
        if size <= 0:
            raise _refuse(f"shm size {size} must be > 0", rid)
        path = os.path.join(SHM_DIR, name)
        # NOTE: the refusals below say nothing of the file (whether it exists, its owner, mode
        # or size: a TCP client could map /dev/shm with them); the reason is logged at DEBUG.
        refused = _refuse(f"shm region {name!r} cannot be attached: a private (0600) file of "
                          "this server's user, of the size offered, that is no file of the "
                          "server's own", rid)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as e:
            logger.debug("shm attach refused: cannot open %s: %s", path, e.strerror)
            raise refused from None
        try:
            st = os.fstat(fd)
            problem = private_file_problem(st, size)
            if problem is None and (st.st_dev, st.st_ino) in forbidden:
                problem = "is the server's own shared-memory store"
            if problem is not None:
                logger.debug("shm attach refused: %s %s", path, problem)
                raise refused
            self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.owner = owner  # the tenant (partition tag) that attached it; "" without tenants
        self.name = name
        self.size = size
        self.view = memoryview(self.mm)

    def check_size(self, rid: int) -> None:
        """The file still has its size (a shrunk file would SIGBUS the server on access)."""
        if os.fstat(self.fd).st_size < self.size:
            raise _refuse("the shm file was shrunk: detached", rid)

    def span(self, offset: Any, length: Any, rid: int) -> slice:
        """The slice [offset, offset + length), checked against the region."""
        if (
            not isinstance(offset, int)
            or not isinstance(length, int)
            or offset < 0
            or length < 0
            or offset > self.size
            or length > self.size - offset
        ):
            raise P.ProtocolError(
                P.ErrorCode.MALFORMED,
                f"shm descriptor (offset {offset}, length {length}) is outside the "
                f"{self.size}-byte region",
                rid,
            )
        return slice(offset, offset + length)

    def close(self) -> None:
        self.view.release()
        self.mm.close()
        os.close(self.fd)


class ShmAttachments:
    """Regions by connection id, LRU, at most `max_bytes` mapped (0: shm refused)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._regions: OrderedDict[bytes, Region] = OrderedDict()
        self.mapped_bytes = 0
        # (st_dev, st_ino) of files no client may attach: the server's own store (mapped as a
        # region it would let a data token read and overwrite every page without a key).
        self.forbidden: frozenset[tuple[int, int]] = frozenset()
        self.counters = {
            "shm_attached": 0,  # attaches accepted over the server's life
            "shm_refused": 0,  # attaches refused
            "shm_dropped": 0,  # attachments dropped to stay under max_bytes
        }

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._regions)

    def attach(self, ident: bytes, name: str, size: int, rid: int, owner: str = "") -> None:
        try:
            if not self.enabled:
                raise _refuse("this server does not accept shared memory (--no-shm)", rid)
            if size > self.max_bytes:
                raise _refuse(f"shm size {size} is over --shm-max-bytes {self.max_bytes}", rid)
            region = Region(name, size, rid, self.forbidden, owner)
        except P.ProtocolError:
            self.counters["shm_refused"] += 1
            raise
        self.detach(ident)
        while self._regions and self.mapped_bytes + size > self.max_bytes:
            old_ident, old = self._regions.popitem(last=False)
            self.mapped_bytes -= old.size
            old.close()
            self.counters["shm_dropped"] += 1
            logger.info("dropped the shm region of an idle connection (--shm-max-bytes)")
        self._regions[ident] = region
        self.mapped_bytes += size
        self.counters["shm_attached"] += 1
        logger.debug("attached %d-byte shm region %s", size, name)

    def detach(self, ident: bytes) -> bool:
        region = self._regions.pop(ident, None)
        if region is None:
            return False
        self.mapped_bytes -= region.size
        region.close()
        return True

    def region(self, ident: bytes, rid: int, owner: str = "") -> Region:
        """The region connection `ident` attached, for a request of tenant `owner` (another
        tenant's connection under the same routing id gets none)."""
        region = self._regions.get(ident)
        if region is None or region.owner != owner:
            raise _refuse("no shm region attached to this connection", rid)
        self._regions.move_to_end(ident)
        region.check_size(rid)
        return region

    def close(self) -> None:
        for ident in list(self._regions):
            self.detach(ident)


def records_in(region: Region, req: P.ShmSetRequest, max_record: int) -> list[memoryview]:
    """The records of a `shm_set`: views of the region (every descriptor checked first), valid
    only while the request is handled (the caller copies them: `Tiers.set(transient=True)`)."""
    rid = req.request_id
    spans = [region.span(o, n, rid) for o, n in zip(req.offsets, req.lengths)]
    for n in req.lengths:
        if n > max_record:
            raise P.ProtocolError(
                P.ErrorCode.TOO_LARGE, f"record of {n} bytes; --max-frame-bytes is {max_record}",
                rid,
            )
    view = region.view
    return [view[s] for s in spans]


def copy_out(
    region: Region, req: P.ShmGetRequest, values: list[Any], view_of: Callable[[Any], memoryview]
) -> list[int]:
    """Write each present value (its bytes: `view_of(value)`) into its slot when it fits; per
    key its length (-1: absent). Every slot is checked before anything is written."""
    rid = req.request_id
    spans = [region.span(o, c, rid) for o, c in zip(req.offsets, req.capacities)]
    view = region.view
    lengths: list[int] = []
    for s, v in zip(spans, values):
        if v is None:
            lengths.append(-1)
            continue
        src = view_of(v)
        n = src.nbytes
        if n <= s.stop - s.start:
            view[s.start : s.start + n] = src.cast("B") if src.format != "B" else src
        lengths.append(n)
    return lengths
