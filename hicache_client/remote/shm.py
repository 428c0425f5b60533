"""The client side of `hicache-server`'s same-host shared-memory data path (protocol v2).

Each pooled connection of `HiCacheServerBackend` creates one region: a file in /dev/shm with a
random name, created with mode 0600 (`O_CREAT | O_EXCL | O_NOFOLLOW`), sized, mapped, and
offered to the server with `attach_shm`. Once the server has attached it, the file is unlinked
(both sides keep their mapping), so nothing is left in /dev/shm whatever happens to the client
later. A region the server refuses is unlinked and closed, and the connection uses TCP frames.

`set`: the records are written into the region and only (key, offset, length) descriptors are
sent; the server copies them out and acknowledges. `get`: the client sends (key, offset,
capacity) slots; the server writes each record that fits its slot and replies with lengths;
the client copies each record whose length is exactly its buffer's into the caller's buffer.
A batch larger than the region goes in rounds; the requests of one round are pipelined.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import zmq

from hicache_client.errors import StorageError
from hicache_client.remote import protocol as P
from hicache_client.remote.shm_files import SHM_DIR

logger = logging.getLogger(__name__)

# Error codes with which a server says it will not take a region (an old server does not know
# the type); the client then stays on TCP frames.
SHM_REFUSALS = (
    P.ErrorCode.NO_SHM, P.ErrorCode.UNKNOWN_TYPE, P.ErrorCode.BAD_VERSION, P.ErrorCode.MALFORMED
)

# Sends requests on one connection and collects their replies in order; on_reply(i, reply)
# runs as each arrives.
Exchange = Callable[[Iterable[P.Request], Callable[[int, P.Reply], None] | None], list[P.Reply]]


class HelloLost(Exception):
    """The server has no hello of this connection (it restarted): its proofs are void."""


class ShmLost(Exception):
    """The server no longer has this connection's region (it restarted, or dropped it)."""


class ClientRegion:
    """A region in /dev/shm owned by this process (mode 0600)."""

    def __init__(self, size: int) -> None:
        self.name = f"hicache-{os.getpid()}-{secrets.token_hex(16)}"
        self.path = os.path.join(SHM_DIR, self.name)
        self.size = size
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.path, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            self.unlink()
            raise
        os.close(fd)
        self.buf = memoryview(self._mm)

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        self.unlink()
        self.buf.release()
        self._mm.close()


class Unreachable(Exception):
    """A round trip got no (valid) answer in time; the socket has been dropped."""


@dataclass
class Wire:
    """What every request of one client carries and waits for."""

    url: str
    token: str
    timeout_ms: int
    ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    releases: bool = True  # send `shm_release` (False: the server is older than protocol 6)
    token_proof: str = "auto"  # "auto", "required" or "off" (connections.Connections._hello)

    def auth(self, nonce: bytes | None, req: P.Request) -> str:
        """The `token` field of `req`: a proof of the token on a connection that said hello
        (`nonce`), else the token itself (none for a hello)."""
        if isinstance(req, P.HelloRequest):
            return ""
        if nonce is None or not self.token:
            return self.token
        return P.request_proof(self.token, nonce, req.request_id, req.TYPE)


@dataclass
class Conn:
    """A pooled DEALER socket and its attached region (None: pages go as TCP frames)."""

    sock: zmq.Socket
    wire: Wire
    region: ClientRegion | None = None
    nonce: bytes | None = None  # the server's hello nonce (None: the token is sent as it is)
    # Slots reserved for this connection in the server's store, by record length: (offset,
    # generation, use-by time) (`store.store_set`).
    slots: dict[int, list[tuple[int, int, float]]] = field(default_factory=dict)
    posted: set[int] = field(default_factory=set)  # ids of releases sent, replies not read

    def exchange(
        self,
        reqs: Iterable[P.Request],
        on_reply: Callable[[int, P.Reply], None] | None = None,
    ) -> list[P.Reply]:
        """Send every request (pipelined on the socket), collect their replies in order.

        `reqs` may be a generator: each request is sent as soon as it is made (a shm set
        writes the next records into the region while the server copies the previous ones).
        `on_reply(i, reply)` runs as each reply arrives, while later ones are still on the
        wire (a get copies its pages out then, so the received buffers are freed and reused).
        Raises `Unreachable` when a reply does not come within the timeout. A `shm_release`
        is sent and not waited for (its reply is dropped as a late one)."""
        s, w = self.sock, self.wire
        try:
            wanted: dict[int, int] = {}
            n = 0
            for i, req in enumerate(reqs):
                if isinstance(req, P.ShmReleaseRequest) and not w.releases:
                    continue
                req.request_id = next(w.ids)
                req.token = w.auth(self.nonce, req)
                wanted[req.request_id] = i
                s.send_multipart(P.encode(req), copy=False)
                if isinstance(req, P.ShmReleaseRequest):
                    del wanted[req.request_id]
                    if len(self.posted) < 1024:
                        self.posted.add(req.request_id)
                    continue
                n += 1
            replies: list[P.Reply | None] = [None] * n
            got = 0
            while got < n:
                # The timeout bounds the wait for each reply, so a large pipelined batch that
                # keeps making progress is not cut short.
                if not s.poll(w.timeout_ms, zmq.POLLIN):
                    raise Unreachable(f"no reply from {w.url} within {w.timeout_ms} ms")
                frames = s.recv_multipart(copy=False)
                msg = P.decode([f.buffer for f in frames], expect="reply")
                i_req = wanted.pop(msg.request_id, None)
                if i_req is None:
                    if msg.request_id in self.posted:  # a release's reply
                        self.posted.discard(msg.request_id)
                        if isinstance(msg, P.ErrorReply) and msg.code in (
                                P.ErrorCode.BAD_VERSION, P.ErrorCode.UNKNOWN_TYPE):
                            w.releases = False  # an older server: it keeps no leases
                        continue
                    if isinstance(msg, P.ErrorReply) and msg.request_id == 0:
                        raise StorageError(f"server error {msg.code}: {msg.message}")
                    continue  # a late reply of an abandoned request
                assert isinstance(msg, P.Reply)
                if isinstance(msg, P.ErrorReply) and msg.code == P.ErrorCode.HELLO:
                    raise HelloLost(msg.message)
                if on_reply is not None:
                    on_reply(i_req, msg)
                replies[i_req] = msg
                got += 1
            return [r for r in replies if r is not None]
        except zmq.Again as e:
            raise Unreachable(f"cannot send to {w.url} within {w.timeout_ms} ms") from e
        except zmq.ZMQError as e:
            raise Unreachable(f"{w.url}: {e}") from e

    def detach(self, timeout_ms: int) -> None:
        """Ask the server to unmap the region (best effort: a server that does not answer in
        time drops it later, least recently used first, under --shm-max-bytes)."""
        req = P.DetachShmRequest(request_id=next(self.wire.ids))
        req.token = self.wire.auth(self.nonce, req)
        try:
            self.sock.send_multipart(P.encode(req), flags=zmq.NOBLOCK)
            if self.sock.poll(timeout_ms, zmq.POLLIN):
                self.sock.recv_multipart()
        except zmq.ZMQError as e:
            logger.debug("hicache backend: detach failed: %s", e)

    def close(self) -> None:
        self.sock.close(linger=0)
        if self.region is not None:
            self.region.close()
            self.region = None


def split(n: int, sizes: Sequence[int] | None, batch_keys: int, batch_bytes: int) -> list[range]:
    """Split n keys into requests of at most `batch_keys` keys and (when the record sizes are
    known) about `batch_bytes` bytes. Smaller requests pipeline: the server works on one while
    the next is still on the wire."""
    out: list[range] = []
    start = 0
    size = 0
    for i in range(n):
        rec = sizes[i] if sizes is not None else 0
        if i > start and (i - start >= batch_keys or size + rec > batch_bytes):
            out.append(range(start, i))
            start, size = i, 0
        size += rec
    if n > start:
        out.append(range(start, n))
    return out


@dataclass
class Chunk:
    """One request: keys idx[0..n) of the batch at offsets in the region."""

    idx: range
    offsets: list[int]
    sizes: list[int]


def plan(sizes: Sequence[int], batch_keys: int, batch_bytes: int, region: int) -> list[list[Chunk]]:
    """Split a batch into rounds of requests: each request at most `batch_keys` keys and
    `batch_bytes` bytes (one record more when a single record is larger), each round's records
    side by side in the region. Every size must be <= `region`."""
    rounds: list[list[Chunk]] = [[]]
    used = 0  # region bytes used by the current round
    chunk: Chunk | None = None
    chunk_bytes = 0
    for i, n in enumerate(sizes):
        if used + n > region:  # the region is full: a new round, from offset 0
            rounds.append([])
            used = 0
            chunk = None
        if chunk is None or len(chunk.idx) >= batch_keys or chunk_bytes + n > batch_bytes:
            chunk = Chunk(range(i, i), [], [])
            rounds[-1].append(chunk)
            chunk_bytes = 0
        chunk.idx = range(chunk.idx.start, i + 1)
        chunk.offsets.append(used)
        chunk.sizes.append(n)
        used += n
        chunk_bytes += n
    return [r for r in rounds if r]


# The per-record field of each reply to a shared-memory request.
_RESULTS: dict[type[P.Reply], str] = {
    P.SetReply: "stored", P.ShmCommitReply: "stored", P.ShmGetReply: "lengths",
    P.ShmLocateReply: "lengths", P.ShmReserveReply: "offsets",
}


def checked(reply: P.Reply, kind: type[P.Reply], n: int) -> None:
    """Raise unless `reply` is a `kind` with `n` results (`ShmLost` for `no_shm`)."""
    if isinstance(reply, P.ErrorReply):
        if reply.code == P.ErrorCode.NO_SHM:
            raise ShmLost(reply.message)
        raise StorageError(f"server answered {reply.code}: {reply.message}")
    if not isinstance(reply, kind):
        raise StorageError(f"server answered {reply.TYPE} to a shm request")
    got = len(getattr(reply, _RESULTS[kind]))
    if got != n:
        raise StorageError(f"server answered {got} results for {n} keys")


def shm_set(
    exchange: Exchange,
    region: ClientRegion,
    keys: Sequence[str],
    records: Sequence[Sequence[memoryview]],
    batch_keys: int,
    batch_bytes: int,
    fill: Callable[[int, memoryview], None] | None = None,
) -> list[bool]:
    """Store `records[i]` (a record's parts as flat byte views, one after the other; each
    record <= the region) under `keys[i]` through the region; per key, whether the server
    stored it. `fill(i, dst)`, when given, writes record i into its place in the region
    instead of a copy of `records[i]` (which then only sizes it)."""
    ok = [False] * len(keys)
    buf = region.buf

    def requests(rnd: list[Chunk]) -> Iterator[P.Request]:
        for c in rnd:  # each request goes out as soon as its records are in the region
            for i, off, n in zip(c.idx, c.offsets, c.sizes):
                if fill is not None:
                    fill(i, buf[off : off + n])
                    continue
                for part in records[i]:
                    n = len(part)
                    buf[off : off + n] = part
                    off += n
            yield P.ShmSetRequest(
                keys=[keys[i] for i in c.idx], offsets=c.offsets, lengths=c.sizes
            )

    sizes = [sum(len(part) for part in parts) for parts in records]
    for rnd in plan(sizes, batch_keys, batch_bytes, region.size):
        for c, r in zip(rnd, exchange(requests(rnd), None)):
            checked(r, P.SetReply, len(c.idx))
            assert isinstance(r, P.SetReply)
            for i, stored in zip(c.idx, r.stored):
                ok[i] = stored is True
    return ok


def shm_get(
    exchange: Exchange,
    region: ClientRegion,
    keys: Sequence[str],
    out: Sequence[memoryview],
    batch_keys: int,
    batch_bytes: int,
    take: Callable[[int, memoryview], None] | None = None,
) -> list[int]:
    """Read `keys` through the region into `out` (flat byte views, each <= the region): per key
    the stored length (-1: absent); the bytes are copied only when it equals `len(out[i])`
    (`take(i, record)`, when given, takes them from the region instead)."""
    res = [-1] * len(keys)
    buf = region.buf
    for rnd in plan([len(o) for o in out], batch_keys, batch_bytes, region.size):

        def copy_out(i_req: int, r: P.Reply, rnd: list[Chunk] = rnd) -> None:
            c = rnd[i_req]
            checked(r, P.ShmGetReply, len(c.idx))
            assert isinstance(r, P.ShmGetReply)
            for i, off, cap, n in zip(c.idx, c.offsets, c.sizes, r.lengths):
                if not isinstance(n, int) or n < -1:
                    raise StorageError(f"server answered length {n!r}")
                res[i] = n
                if n >= 0 and n == cap:  # == len(out[i]): within the slot by construction
                    if take is not None:
                        take(i, buf[off : off + n])
                    else:
                        out[i][:] = buf[off : off + n]

        reqs: list[P.Request] = [
            P.ShmGetRequest(keys=[keys[i] for i in c.idx], offsets=c.offsets, capacities=c.sizes)
            for c in rnd
        ]
        exchange(reqs, copy_out)
    return res
