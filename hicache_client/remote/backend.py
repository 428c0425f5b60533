"""`hicache`: the client of our own `hicache-server` (ZeroMQ DEALER sockets, msgpack headers).

Extra config (JSON) and environment:

===============  ================================================  ==========================
key              meaning                                           default
===============  ================================================  ==========================
``url``          the server (env ``HICACHE_SERVER_URL``)           ``tcp://127.0.0.1:7480``
``auth_token``   shared token (env ``HICACHE_SERVER_AUTH_TOKEN``)  none
``timeout_ms``   longest wait for one reply; past it the socket    2000
                 is dropped and the call degrades to a miss
``batch_keys``   most keys in one request (a larger batch is       256
                 split and the parts are pipelined)
``batch_bytes``  most record bytes in one request (get or set)      4194304 (4 MiB)
``tune_malloc``  let glibc reuse freed large blocks (process-wide;   true
                 see `hicache_client.remote.malloc.tune_malloc`):
                 ~3x faster receives of 1 MiB pages
``shm``          a shared-memory region per connection, and the    true
                 server's store (same host; shm, _store)
``shm_bytes``    size of each connection's region; a batch larger  4 x ``batch_bytes``
                 goes in rounds of requests of 1/8 of it, a record
                 larger goes over TCP
``shm_populate`` fill this process's page tables for the part of   true
                 the server's store that holds space, on a
                 background thread (store.Populator), so
                 first copies do not fault page by page
``token_proof``  ``auto``: prove the token (an HMAC per request over  ``auto``
                 the connection's hello nonce; protocol 7) and
                 check the server's proof that it holds the token;
                 a server before protocol 7 gets the token as it
                 is. ``required``: refuse such a server. ``off``:
                 send the token as it is
``server_``      the server's Ed25519 public key (64 hex characters  none (the server is
``public_key``   or the path of its FILE.pub / a PEM file): refuse  not checked by key)
                 a server whose hello is not signed by it (its
                 --server-key), at start-up (env
                 ``HICACHE_SERVER_PUBLIC_KEY``)
``encryption_``  64 hex characters: seal every record with         none (records in the
``key``          AES-256-GCM under this key (seal); the    clear)
                 server stores and serves ciphertext. Every client
                 of one tenant holds the same key (env
                 ``HICACHE_SERVER_ENCRYPTION_KEY``). A request
                 of sealed records holds as many as a plain one:
                 its byte limits grow by the seal's 28 bytes a key
===============  ================================================  ==========================

A dead or unreachable server never fails the caller: `batch_exists` answers 0, `batch_get`
misses, `batch_set` reports False, each counted in `stats().errors`; a circuit breaker
(`hicache_client.backoff.Backoff`) then answers at once without touching the network until the
next retry. `delete` and the clears raise `StorageUnavailable` instead (they are administrative and
their caller must know they did not happen). A wrong token is a `ConfigError` at construction
when the server is reachable then, and a logged, counted failure afterwards.

Thread-safe: each call checks a socket out of a small pool, so concurrent prefetch and backup
threads run their round trips in parallel.

`batch_get_parts` / `batch_set_parts` (records held in several buffers: a header buffer and the
regions of a page in a host pool) copy each record straight between the server's store and the
caller's parts on the same host (one copy), and go through a temporary per record otherwise.

Modules: this one (the operations), `connections` (the pooled connections and the circuit
breaker), `shm` (the connection's region), `store` (the server's store).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, ClassVar, TypeVar

from hicache_client.backend import (
    BackendStats,
    Checked,
    HeaderCheck,
    RecordChecker,
    StorageBackend,
    StorageConfig,
    ThreadBuffers,
    byte_view,
    gather,
    scatter,
)
from hicache_client.backend_util import check_known_keys, each_key_once, setting
from hicache_client.codec import (
    HEADER_BYTES,
    RecordHeader,
    verify_copied_parts,
    verify_record,
    verify_record_head,
)
from hicache_client.errors import ConfigError, StorageCorrupt, StorageError, StorageUnavailable
from hicache_client.remote import protocol as P
from hicache_client.remote.connections import Connections
from hicache_client.remote.malloc import tune_malloc
from hicache_client.remote.shm import Conn, shm_get, shm_set, split
from hicache_client.remote.store import (
    NOT_MAPPED,
    ReserveRefused,
    StoreAccess,
    StoreMap,
    locate,
    locate_get,
    store_set,
)

if TYPE_CHECKING:
    from hicache_client.remote.seal import Sealer

# hicache_client.remote.seal's (not imported: it needs cryptography; a test checks they agree)
SEALED_MAGIC = b"HKVS"
SEAL_OVERHEAD = 28

logger = logging.getLogger(__name__)

KNOWN_KEYS = ("url", "auth_token", "timeout_ms", "batch_keys", "batch_bytes", "tune_malloc",
              "shm", "shm_bytes", "shm_populate", "encryption_key", "token_proof",
              "server_public_key")
ENCRYPTION_ENV = "HICACHE_SERVER_ENCRYPTION_KEY"
SERVER_KEY_ENV = "HICACHE_SERVER_PUBLIC_KEY"
DEFAULT_URL = "tcp://127.0.0.1:7480"
_ABSENT = Checked(-1, None)

R = TypeVar("R", bound=P.Reply)


class HiCacheServerBackend(StorageBackend):
    """Pages in a shared `hicache-server`."""

    name: ClassVar[str] = "hicache"

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        check_known_keys(config, KNOWN_KEYS, self.name)
        self.url = setting(config, "url", DEFAULT_URL, env="HICACHE_SERVER_URL", cast=str)
        token = setting(config, "auth_token", "", env="HICACHE_SERVER_AUTH_TOKEN", cast=str)
        self.timeout_ms = setting(config, "timeout_ms", 2000)
        self.batch_keys = setting(config, "batch_keys", 256)
        self.batch_bytes = setting(config, "batch_bytes", 4 << 20)
        self.shm_bytes = setting(config, "shm_bytes", 4 * self.batch_bytes)
        if min(self.timeout_ms, self.batch_keys, self.batch_bytes, self.shm_bytes) <= 0:
            raise ConfigError(
                "hicache backend: timeout_ms, batch_keys, batch_bytes, shm_bytes must be > 0"
            )
        # shm requests are smaller (8 per region) so the two sides' copies overlap.
        self._shm_request_bytes = min(self.batch_bytes, max(1, self.shm_bytes // 8))
        self._request_bytes = self.batch_bytes  # of the records in one get or set over TCP
        shm = setting(config, "shm", True)
        secret = setting(config, "encryption_key", "", env=ENCRYPTION_ENV, cast=str)
        self._sealer: Sealer | None = None
        self._cannot_read: set[str] = set()  # `_unreadable`, until `report_corrupt` sees them
        self._cannot_read_lock = threading.Lock()
        if secret:
            from hicache_client.remote.seal import OVERHEAD, Sealer, parse_key

            self._sealer = Sealer(parse_key(secret))
            self._sealed_buffers = ThreadBuffers()  # sealed records on their way in or out
            # A sealed request carries the records a plain one would: its budget grows by the
            # seal's bytes per key (without it two sealed 1 MiB records overflow a 2 MiB
            # region request, and a set or get went in twice the requests).
            slack = OVERHEAD * self.batch_keys
            self._shm_request_bytes += slack
            self._request_bytes += slack
        if setting(config, "tune_malloc", True):
            tune_malloc()
        proof = setting(config, "token_proof", "auto", cast=str)
        if proof not in ("auto", "required", "off"):
            raise ConfigError(f"hicache backend: token_proof must be auto, required or off, "
                              f"got {proof!r}")
        pinned = setting(config, "server_public_key", "", env=SERVER_KEY_ENV, cast=str)
        server_key = None
        if pinned:
            from hicache_client.remote.identity import parse_public_key

            server_key = parse_public_key(pinned, "hicache backend: server_public_key")
        self.conns = Connections(self.url, token, self.timeout_ms, shm=shm,
                                 shm_bytes=self.shm_bytes, namespace=self._namespace,
                                 populate=setting(config, "shm_populate", True),
                                 token_proof=proof, server_key=server_key)
        self._warned: set[str] = set()
        self.max_frame_bytes = 0  # the server's limit, learnt from ping (0: unknown)
        self._probe()

    @property
    def arena(self) -> StoreAccess:
        """The server's store as this client uses it (mapping, counters)."""
        return self.conns.arena

    @property
    def shm_enabled(self) -> bool:
        """Whether new connections offer a region (off by config, or after a refusal)."""
        return self.conns.shm_enabled

    # -- round trips ------------------------------------------------------------------------

    def _probe(self) -> None:
        """Ping once: learn the frame limit, refuse a wrong token early. A server that is not
        up yet is fine (the engine runs on L1/L2 until it comes)."""
        try:
            pong = self._call([P.PingRequest()], P.PingReply)[0]
        except StorageUnavailable as e:
            logger.warning("hicache-server at %s not reachable yet: %s", self.url, e)
            return
        except StorageError as e:
            self.close()
            raise ConfigError(f"hicache backend: {self.url} refused us: {e}") from e
        self.max_frame_bytes = pong.max_frame_bytes
        logger.info(
            "hicache backend connected to %s (server %s, protocol %d)",
            self.url,
            pong.server_version,
            pong.protocol_version,
        )

    def _call(
        self,
        reqs: Sequence[P.Request],
        kind: type[R],
        on_reply: Callable[[int, P.Reply], None] | None = None,
    ) -> list[R]:
        """Round trip under the circuit breaker. Raises `StorageUnavailable` (transient) or
        `StorageError` (an error reply: wrong token, a request the server refused)."""
        replies = self.conns.session(lambda c: c.exchange(reqs, on_reply))
        return self._expect(replies, reqs, kind)

    def _expect(self, replies: list[P.Reply], reqs: Sequence[P.Request], kind: type[R]) -> list[R]:
        out: list[R] = []
        for r in replies:
            if isinstance(r, P.ErrorReply):
                raise StorageError(f"{self.url} answered {r.code}: {r.message}")
            if not isinstance(r, kind):
                raise StorageError(f"{self.url} answered {r.TYPE} to a {reqs[0].TYPE} request")
            out.append(r)
        return out

    def _degraded(self, op: str, e: StorageError) -> None:
        """Count a failed operation; log the first of each kind loudly."""
        self._count(errors=1)
        kind = f"{op}:{type(e).__name__}"
        if kind not in self._warned and not isinstance(e, StorageUnavailable):
            self._warned.add(kind)
            logger.error("hicache backend: %s failed: %s", op, e)
        else:
            logger.debug("hicache backend: %s failed: %s", op, e)

    # -- the contract -----------------------------------------------------------------------

    def batch_exists(self, keys: Sequence[str]) -> int:
        self._count(exists_calls=1)
        if not keys:
            return 0
        chunks = split(len(keys), None, self.batch_keys, self.batch_bytes)
        try:
            replies = self._call(
                [P.ExistsRequest(keys=list(keys[c.start : c.stop])) for c in chunks], P.ExistsReply
            )
        except StorageError as e:
            self._degraded("exists", e)
            return 0
        run = 0
        for c, r in zip(chunks, replies):
            run += r.count
            if r.count < len(c):
                break
        return run

    def _get_checked(self, keys: Sequence[str], out: Sequence[memoryview]) -> list[Checked]:
        if self._sealer is not None:
            return self._get_sealed(keys, out, self._sealer)
        # Records read in place are checked by this thread as each is copied, while in its cache.
        checker = RecordChecker(self, len(keys), offload=False)
        early: set[int] = set()

        def landed(i: int, n: int) -> None:
            early.add(i)
            checker.add(i, keys[i], n, out[i])

        lengths = self._get_into(keys, out, landed)
        for i, n in enumerate(lengths):
            if i not in early:
                checker.add(i, keys[i], n, out[i])
        return [c if n >= 0 else Checked(-1, None)
                for c, n in zip(checker.results(), lengths)]

    def _get_sealed(self, keys: Sequence[str], out: Sequence[memoryview],
                    sealer: Sealer) -> list[Checked]:
        """Read sealed records and open each into its buffer: straight from a received TCP
        frame, or from a temporary (the region and store paths copy into it first); then
        check it as a plain record (the tag has verified every byte: the checksum is not
        computed twice)."""
        from hicache_client.remote.seal import OVERHEAD

        views = [byte_view(o) for o in out]
        sealed = self._sealed_buffers.take([len(v) + OVERHEAD for v in views])
        opened: dict[int, str | None] = {}

        def take(i: int, src: P.Buffer | None) -> None:
            if src is None:  # what was taken is void (the record moved): read another way
                opened.pop(i, None)
            else:
                opened[i] = sealer.open_into(keys[i], memoryview(src), views[i])

        lengths = self._get_into(keys, sealed, take=take)
        res: list[Checked] = []
        for i, (key, n, s, o) in enumerate(zip(keys, lengths, sealed, views)):
            if n < 0:
                res.append(_ABSENT)
            elif n != len(s):
                res.append(Checked(n, f"stored sealed record is {n} bytes, expected {len(s)}"))
            else:
                problem = opened[i] if i in opened else sealer.open_into(key, s, o)
                if problem is not None and not problem.startswith("sealed record is "):
                    self._unreadable(key)  # another key, plain, or altered: not proof
                res.append(Checked(len(o), problem or self._check_opened(key, o)))
        return res

    def _unreadable(self, key: str) -> None:
        """`key` was read but could not be opened here, which proves nothing about it."""
        with self._cannot_read_lock:
            self._cannot_read.add(key)

    def check_record(self, key: str, length: int, buf: memoryview) -> str | None:
        problem = super().check_record(key, length, buf)
        size = len(memoryview(buf).cast("B"))
        if problem is not None and self._sealer is None and (
                length == size + SEAL_OVERHEAD
                or (length == size >= 4 and bytes(memoryview(buf).cast("B")[:4]) == SEALED_MAGIC)):
            self._unreadable(key)
            return "sealed record and this client has no encryption_key (a miss, kept)"
        return problem

    def report_corrupt(self, keys: Sequence[str]) -> None:
        """`StorageBackend.report_corrupt` of the keys proven corrupt only: a sealed record
        that does not open here (no or another encryption_key, or bits flipped on the way by
        a man in the middle) is a miss and stays, for the clients that can read it."""
        with self._cannot_read_lock:
            bad = [k for k in keys if k not in self._cannot_read]
            self._cannot_read.difference_update(keys)
        if bad:
            super().report_corrupt(bad)

    def _check_opened(self, key: str, record: memoryview) -> str | None:
        """`check_record` of a record that opened (its tag verified it): all but the checksum."""
        try:
            header = verify_record(record, key, checksum=False)
        except StorageCorrupt as e:
            return str(e)
        if self._namespace and header.namespace != self._namespace:
            return "record is from another namespace"
        return None

    def _get_into(
        self,
        keys: Sequence[str],
        out: Sequence[memoryview],
        landed: Callable[[int, int], None] | None = None,
        in_place: bool = True,
        take: Callable[[int, P.Buffer | None], None] | None = None,
    ) -> list[int]:
        """Raw read (`StorageBackend._get_into`): from the server's store in place when mapped
        (unless `in_place` is False), then through the region, then as TCP frames."""
        if len(set(keys)) != len(keys):  # the server refuses repeated keys: ask for each once
            return each_key_once(keys, out, self._get_into)
        views = [byte_view(o) for o in out]
        res = [-1] * len(keys)
        chunks: list[range] = []
        tcp_idx: list[int] = []  # batch positions the TCP path reads

        def copy_out(i_req: int, r: P.Reply) -> None:
            if not isinstance(r, P.GetReply) or len(r.lengths) != len(chunks[i_req]):
                return  # judged by _expect / below
            frames = iter(r.frames)
            for j, n in zip(chunks[i_req], r.lengths):
                i = tcp_idx[j]
                res[i] = n
                if n >= 0:
                    src = next(frames)
                    dst = views[i]
                    if n == len(dst):
                        if take is not None:
                            take(i, src)
                        else:
                            dst[:] = src
            r.frames = []  # release the received buffers now

        def work(conn: Conn) -> list[P.Reply]:
            exchange = conn.exchange
            idx = list(range(len(keys)))
            store = self.conns.store_map(conn) if in_place else None
            if store is not None:  # in place from the server's arena; the rest another way
                res[:] = locate_get(exchange, store, keys, views, self.batch_keys, landed, take)
                idx = [i for i, n in enumerate(res) if n == NOT_MAPPED]
                self.arena.count(reads=len(keys) - len(idx), fallbacks=len(idx))
                if not idx:
                    return []
            region = conn.region
            if region is not None and max((len(views[i]) for i in idx), default=0) <= region.size:
                got = shm_get(exchange, region, [keys[i] for i in idx], [views[i] for i in idx],
                              self.batch_keys, self._shm_request_bytes,
                              None if take is None else (lambda j, src: take(idx[j], src)))
                for i, n in zip(idx, got):
                    res[i] = n
                return []
            tcp_idx[:] = idx
            chunks[:] = split(len(idx), [len(views[i]) for i in idx], self.batch_keys,
                              self._request_bytes)
            reqs = [P.GetRequest(keys=[keys[idx[j]] for j in c]) for c in chunks]
            return exchange(reqs, copy_out)

        try:
            replies = self.conns.shm_op(work)
            if chunks:  # the TCP path ran
                gets = self._expect(replies, [P.GetRequest()], P.GetReply)
                if [len(r.lengths) for r in gets] != [len(c) for c in chunks]:
                    raise StorageError("reply has the wrong number of pages")
        except StorageError as e:
            self._degraded("get", e)
            return [-1] * len(keys)
        return res

    def _get_parts_checked(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]],
                           accept: HeaderCheck | None) -> list[Checked]:
        """Records in the server's store go straight into their parts: each record's header is
        judged where it lies first (so a record of another key, namespace or format, or of the
        wrong length, is never copied), then the record is copied into its parts and checked
        there, whole, checksum included; a generation that changed during either copy sends the
        record the other way. The rest (not in the store, moved, no store here, a batch naming
        a key twice) go through temporaries (`StorageBackend._get_parts_checked`), so their
        parts are written only with a valid, accepted record."""
        if len(set(keys)) != len(keys) or not self.arena.wanted or self._sealer is not None:
            return super()._get_parts_checked(keys, parts, accept)
        sizes = [sum(len(p) for p in ps) for ps in parts]
        res: list[Checked | None] = [None] * len(keys)  # None: read another way
        located: list[bool] = []  # whether the store was asked

        def work(conn: Conn) -> list[P.Reply]:
            store = self.conns.store_map(conn)
            if store is None:
                return []
            located.append(True)

            def take(i: int, off: int, n: int, gen: int) -> None:
                if n < 0:
                    res[i] = _ABSENT
                elif n != sizes[i]:  # nothing copied
                    res[i] = Checked(n, f"stored record is {n} bytes, expected {sizes[i]}")
                elif off >= 0:
                    res[i] = self._copy_parts(store, keys[i], parts[i], off, n, gen, accept)

            locate(conn.exchange, store, keys, self.batch_keys, take)
            return []

        try:
            self.conns.shm_op(work)
        except StorageError as e:
            self._degraded("get", e)
            return [_ABSENT] * len(keys)
        rest = [i for i, c in enumerate(res) if c is None]
        if located:
            self.arena.count(reads=len(keys) - len(rest), fallbacks=len(rest))
        if rest:  # through the region or TCP into temporaries, checked, then into the parts
            tmp = self._scratch([sizes[i] for i in rest])
            sub = [keys[i] for i in rest]
            lengths = self._get_into(sub, tmp, in_place=False)
            for i, key, n, t in zip(rest, sub, lengths, tmp):
                c = Checked(n, self.check_record(key, n, t)) if n >= 0 else _ABSENT
                res[i] = self._deliver(key, c, t, parts[i], accept)
        return [c if c is not None else _ABSENT for c in res]

    def _copy_parts(self, store: StoreMap, key: str, parts: Sequence[memoryview], off: int,
                    n: int, gen: int, accept: HeaderCheck | None) -> Checked | None:
        """Record `key` (`n` bytes at `off`, generation `gen`) from the store into `parts`,
        judged and checked (`_get_parts_checked`); None when it must be read another way."""
        src = store.view(off, n, gen)
        if src is None:
            return None
        head = bytes(src[:HEADER_BYTES])
        header: RecordHeader | None = None
        try:
            header = verify_record_head(head, key, n)
        except StorageCorrupt as e:
            problem: str | None = str(e)
        if header is not None:
            problem = self._judge(key, header, accept)
        if not store.current(off, gen):
            return None  # the header changed under us: that verdict is void
        if header is None or problem is not None:
            return Checked(n, problem)  # the parts are untouched
        scatter(src, parts)
        if not store.current(off, gen):
            return None  # freed during the copy: the parts hold part of it, unchecked
        # The header judged above is the one copied (compared byte for byte), so the verdict
        # holds for the copy; what is left to check is the checksum over the parts.
        try:
            verify_copied_parts(parts, head, header.version)
        except StorageCorrupt as e:
            return Checked(n, str(e))
        return Checked(n, None)

    def _judge(self, key: str, header: RecordHeader, accept: HeaderCheck | None) -> str | None:
        """Why a record with this valid `header` is not wanted (another namespace, refused by
        `accept`), or None."""
        if self._namespace and header.namespace != self._namespace:
            return "record is from another namespace"
        return accept(key, header) if accept is not None else None

    def batch_set(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        if not keys:
            return []
        return self._set_parts(keys, [(byte_view(v),) for v in values])

    def _set_parts(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]
                   ) -> list[bool]:
        if self._sealer is None:
            return self._send_parts(keys, parts)
        from hicache_client.remote.seal import OVERHEAD

        sealer = self._sealer
        sizes = [sum(len(p) for p in ps) for ps in parts]
        plain: list[memoryview] | None = None
        # Each record's header and payload parts: sealed where they lie (a page's regions in a
        # host pool, e.g. SGLang's [header, K, V]), with no staging copy.
        pieces: list[tuple[memoryview, Sequence[memoryview]]] = []
        idx: list[int] = []  # the records that are page records (the rest are not stored)
        for i, (key, ps) in enumerate(zip(keys, parts)):
            if ps and len(ps[0]) >= HEADER_BYTES:
                head = ps[0][:HEADER_BYTES]
                payload = [p for p in (ps[0][HEADER_BYTES:], *ps[1:]) if len(p)]
            else:  # the header itself in parts: the record is gathered first
                if plain is None:
                    plain = self._scratch(sizes)
                gather(ps, plain[i])
                head, payload = plain[i][:HEADER_BYTES], [plain[i][HEADER_BYTES:]]
            problem = sealer.refuses(head)
            if problem is not None:
                logger.debug("hicache backend: not sealing %s: %s", key[:16], problem)
                continue
            idx.append(i)
            pieces.append((head, payload))
        # The sealed records' buffers: written by `seal` where the record does not go straight
        # into a slot of the server's store (sealed there).
        sealed = self._sealed_buffers.take([sizes[i] + OVERHEAD for i in idx])

        def seal(j: int, dst: memoryview) -> None:
            sealer.seal_into(keys[idx[j]], pieces[j][0], pieces[j][1], dst)

        got = self._send_parts([keys[i] for i in idx], [(s,) for s in sealed], seal) \
            if idx else []
        ok = [False] * len(keys)
        for i, stored in zip(idx, got):
            ok[i] = stored
        return ok

    def _send_parts(self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]],
                    seal: Callable[[int, memoryview], None] | None = None) -> list[bool]:
        """Store records held in parts (one part each for `batch_set`): straight into slots
        of the server's store (one copy), else through the region (one copy there), else as
        TCP frames (a record of several parts is joined into one frame first). `seal(i, dst)`:
        the records are sealed, `parts[i]` only their buffer (written by `seal` first, unless
        record i is sealed straight into a slot of the store)."""
        sizes = [sum(len(p) for p in ps) for ps in parts]
        # A record over the server's frame limit is not sent.
        send = [i for i, n in enumerate(sizes) if not self.max_frame_bytes
                or n <= self.max_frame_bytes]
        ok = [False] * len(keys)
        index: list[list[int]] = []

        def work(conn: Conn) -> list[P.Reply]:
            idx = send
            store = self.conns.store_map(conn) if self.arena.writes_wanted else None
            if store is not None:  # straight into the server's arena; the rest another way
                idx = self._store_set(conn, store, keys, parts, idx, ok, seal)
                if not idx:
                    return []
            region = conn.region
            if region is not None and max(sizes[i] for i in idx) <= region.size:
                # Sealed records are sealed straight into the region.
                fill = None if seal is None else (lambda j, dst: seal(idx[j], dst))
                got = shm_set(conn.exchange, region, [keys[i] for i in idx],
                              [parts[i] for i in idx], self.batch_keys, self._shm_request_bytes,
                              fill)
                for i, stored in zip(idx, got):
                    ok[i] = stored
                return []
            # Split by key count and bytes; the parts are pipelined. Sealed records are sealed
            # request by request, each just before it is sent: the server receives and stores
            # one request while the next is sealed (sealing all first left it idle meanwhile).
            # Requests stay as large as plain ones (smaller ones cost the server more per page).
            reqs: list[P.SetRequest] = []
            index.clear()
            size = 0
            for i in idx:
                if not reqs or len(index[-1]) >= self.batch_keys \
                        or size + sizes[i] > self._request_bytes:
                    reqs.append(P.SetRequest())
                    index.append([])
                    size = 0
                reqs[-1].keys.append(keys[i])
                reqs[-1].frames.append(parts[i][0] if len(parts[i]) == 1 else b"".join(parts[i]))
                index[-1].append(i)
                size += sizes[i]
            if seal is None:
                return conn.exchange(reqs)

            def sealed_reqs() -> Iterator[P.SetRequest]:
                for req, ix in zip(reqs, index):
                    for i in ix:
                        seal(i, parts[i][0])
                    yield req

            return conn.exchange(sealed_reqs())

        if send:
            try:
                replies = self._expect(self.conns.shm_op(work), [P.SetRequest()], P.SetReply)
            except StorageError as e:
                self._degraded("set", e)
                replies = []
            for idx, r in zip(index, replies):
                for i, stored in zip(idx, r.stored):
                    ok[i] = stored
        written = sum(n for n, o in zip(sizes, ok) if o)
        self._count(set_pages=len(keys), set_failures=ok.count(False), bytes_written=written)
        return ok

    def _store_set(self, conn: Conn, store: StoreMap, keys: Sequence[str],
                   parts: Sequence[Sequence[memoryview]], idx: list[int],
                   ok: list[bool], seal: Callable[[int, memoryview], None] | None = None
                   ) -> list[int]:
        """Write records `idx` into slots of the server's store (one copy; sealed into them
        with `seal`); those left over."""
        fill = None if seal is None else (lambda j, dst: seal(idx[j], dst))
        try:
            got = store_set(conn.exchange, store, conn.slots, [keys[i] for i in idx],
                            [parts[i] for i in idx], self.batch_keys, fill)
        except ReserveRefused as e:
            self.arena.refused_writes(str(e))
            return idx
        rest = [i for i, r in zip(idx, got) if r is None]
        for i, r in zip(idx, got):
            ok[i] = r is True
        self.arena.count(writes=len(idx) - len(rest), write_fallbacks=len(rest))
        return rest

    def delete(self, keys: Sequence[str]) -> None:
        reqs = [P.DeleteRequest(keys=list(keys[c.start : c.stop]))
                for c in split(len(keys), None, self.batch_keys, self.batch_bytes)] if keys else []
        if reqs:
            self._count(deleted_pages=sum(r.deleted for r in self._admin(reqs, P.DeleteReply)))

    def clear(self) -> None:
        """Delete this namespace's pages (`config.namespace`) on the server, no others; without
        a namespace, `ConfigError` (the whole server is the admin's `clear_server`)."""
        if not self._namespace:
            raise ConfigError("hicache backend: clear() needs StorageConfig.namespace")
        self.clear_namespace(self._namespace)

    def clear_namespace(self, namespace: bytes) -> int:
        """Delete every page whose record names `namespace` (memory and disk); how many."""
        if len(namespace) != 32:
            raise ConfigError("hicache backend: a namespace is a 32-byte seed")
        req = P.ClearNamespaceRequest(namespace=namespace.hex())
        n = self._admin([req], P.ClearNamespaceReply)[0].deleted
        self._count(deleted_pages=n)
        return n

    def clear_server(self) -> None:
        """Empty the whole server, every namespace (the admin's operation, never an engine's)."""
        self._admin([P.ClearRequest()], P.ClearReply)

    def _admin(self, reqs: Sequence[P.Request], kind: type[R]) -> list[R]:
        """`_call` for the administrative operations: a failure is counted, then raised."""
        try:
            return self._call(reqs, kind)
        except StorageError:
            self._count(errors=1)
            raise

    def server_stats(self) -> dict[str, int]:
        """The server's own counters (pages, bytes, hits, evictions, persistence...)."""
        return self._call([P.StatsRequest()], P.StatsReply)[0].stats

    def ping(self) -> P.PingReply:
        return self._call([P.PingRequest()], P.PingReply)[0]

    def stats(self) -> BackendStats:
        """Counters of this client; `stored_pages` / `stored_bytes` are the server's (memory
        tier) when it answers, -1 when it does not."""
        pages = nbytes = -1
        if not self.conns.closed and not self.conns.backoff.down:
            try:
                s = self.server_stats()
                pages, nbytes = s.get("pages", -1), s.get("bytes", -1)
            except StorageError as e:
                logger.debug("hicache backend: server stats unavailable: %s", e)
        self._set_gauge(stored_pages=pages, stored_bytes=nbytes)
        return super().stats()

    def close(self) -> None:
        self.conns.close()
