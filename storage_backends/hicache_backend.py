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
                 see `storage_backends.server.store.tune_malloc`):
                 ~3x faster receives of 1 MiB pages
``shm``          a shared-memory region per connection, and the    true
                 server's store (same host; hicache_shm, _store)
``shm_bytes``    size of each connection's region; a batch larger  4 x ``batch_bytes``
                 goes in rounds of requests of 1/8 of it, a record
                 larger goes over TCP
===============  ================================================  ==========================

A dead or unreachable server never fails the caller: `batch_exists` answers 0, `batch_get`
misses, `batch_set` reports False, each counted in `stats().errors`; a circuit breaker
(`storage_backends.common.Backoff`) then answers at once without touching the network until the
next retry. `delete` and `clear` raise `StorageUnavailable` instead (they are administrative and
their caller must know they did not happen). A wrong token is a `ConfigError` at construction
when the server is reachable then, and a logged, counted failure afterwards.

Thread-safe: each call checks a socket out of a small pool, so concurrent prefetch and backup
threads run their round trips in parallel.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import ClassVar, TypeVar

import zmq

from hicache.backend import Checked, RecordChecker
from hicache.errors import ConfigError, StorageError, StorageUnavailable
from hicache.storage import BackendStats, StorageBackend, StorageConfig
from storage_backends.common import Backoff, byte_view, check_known_keys, each_key_once, setting
from storage_backends.hicache_shm import (
    SHM_REFUSALS,
    ClientRegion,
    ShmLost,
    Unreachable,
    Wire,
    shm_get,
    shm_set,
    split,
)
from storage_backends.hicache_shm import Conn as _Conn
from storage_backends.hicache_store import (
    NOT_MAPPED,
    ReserveRefused,
    StoreAccess,
    StoreMap,
    locate_get,
    store_set,
)
from storage_backends.server import protocol as P
from storage_backends.server.store import tune_malloc

logger = logging.getLogger(__name__)

KNOWN_KEYS = ("url", "auth_token", "timeout_ms", "batch_keys", "batch_bytes", "tune_malloc",
              "shm", "shm_bytes")
DEFAULT_URL = "tcp://127.0.0.1:7480"

R = TypeVar("R", bound=P.Reply)


class HiCacheServerBackend(StorageBackend):
    """Pages in a shared `hicache-server`."""

    name: ClassVar[str] = "hicache"

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        check_known_keys(config, KNOWN_KEYS, self.name)
        self.url = setting(config, "url", DEFAULT_URL, env="HICACHE_SERVER_URL", cast=str)
        self._token = setting(config, "auth_token", "", env="HICACHE_SERVER_AUTH_TOKEN", cast=str)
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
        # Whether new connections offer a region: off by config, or after a server refused one.
        self.shm_enabled = setting(config, "shm", True)
        # The server's shared-memory store, mapped on first use (`hicache_store`).
        self.arena = StoreAccess(self.shm_enabled)
        if setting(config, "tune_malloc", True):
            tune_malloc()
        self._ctx = zmq.Context(io_threads=1)
        self._pool: list[_Conn] = []
        self._pool_lock = threading.Lock()
        self._wire = Wire(self.url, self._token, self.timeout_ms)
        self._closed = False
        self._warned: set[str] = set()
        self.max_frame_bytes = 0  # the server's limit, learnt from ping (0: unknown)
        self._backoff = Backoff(f"hicache-server {self.url}", initial_s=0.05, max_s=2.0)
        self._probe()

    # -- connection -------------------------------------------------------------------------

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

    def _checkout(self) -> _Conn:
        with self._pool_lock:
            if self._closed:
                raise StorageUnavailable("hicache backend is closed")
            if self._pool:
                return self._pool.pop()
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        s.setsockopt(zmq.RECONNECT_IVL, 50)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        s.connect(self.url)
        conn = _Conn(s, self._wire)
        if self.shm_enabled:
            try:
                self._attach(conn)
            except BaseException:
                conn.close()
                raise
        return conn

    def _attach(self, conn: _Conn) -> None:
        """Offer the server a new region for `conn`; on a refusal, stay on TCP (log once)."""
        try:
            region = ClientRegion(self.shm_bytes)
        except OSError as e:
            self._no_shm(f"cannot create a region in /dev/shm: {e}")
            return
        try:
            reply = conn.exchange([P.AttachShmRequest(name=region.name,
                                                                   size=region.size)])[0]
        except BaseException:
            region.close()
            raise
        region.unlink()  # attached or not, the name is no longer needed: nothing is left behind
        if isinstance(reply, P.AttachShmReply):
            conn.region = region
            return
        region.close()
        if not isinstance(reply, P.ErrorReply):
            raise StorageError(f"{self.url} answered {reply.TYPE} to attach_shm")
        if reply.code not in SHM_REFUSALS:  # e.g. a wrong token: refused like any request
            raise StorageError(f"{self.url} answered {reply.code}: {reply.message}")
        self._no_shm(f"the server refused the region ({reply.code}: {reply.message})")

    def _store_map(self, conn: _Conn) -> StoreMap | None:
        """The server's store, when this connection has a region (the same host)."""
        if conn.region is None:
            return None
        return self.arena.mapped(lambda req: conn.exchange([req])[0])

    def _store_set(self, conn: _Conn, store: StoreMap, keys: Sequence[str],
                   views: Sequence[memoryview], idx: list[int], ok: list[bool]) -> list[int]:
        """Write records `idx` into slots of the server's store (one copy); those left over."""
        try:
            got = store_set(conn.exchange, store, conn.slots, [keys[i] for i in idx],
                            [views[i] for i in idx], self.batch_keys)
        except ReserveRefused as e:
            self.arena.refused_writes(str(e))
            return idx
        rest = [i for i, r in zip(idx, got) if r is None]
        for i, r in zip(idx, got):
            ok[i] = r is True
        self.arena.count(writes=len(idx) - len(rest), write_fallbacks=len(rest))
        return rest

    def _no_shm(self, why: str) -> None:
        if self.shm_enabled:
            self.shm_enabled = False
            logger.info("hicache backend: shared memory off, pages go over TCP: %s", why)

    def _release(self, conn: _Conn, healthy: bool) -> None:
        with self._pool_lock:
            if healthy and not self._closed:
                self._pool.append(conn)
                return
        conn.close()

    def _drop_pool(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, []
        for conn in pool:
            conn.close()

    def _session(self, work: Callable[[_Conn], list[P.Reply]]) -> list[P.Reply]:
        """Run `work` on one pooled connection under the circuit breaker. Raises
        `StorageUnavailable` (no answer in time; the connection is dropped), `ShmLost` or
        whatever `work` raises (the server answered: the breaker is closed)."""
        self._backoff.check()
        healthy = False
        conn: _Conn | None = None
        try:
            conn = self._checkout()
            replies = work(conn)
            healthy = True
        except Unreachable as e:
            self._backoff.failure(e)
            raise StorageUnavailable(str(e)) from e
        except BaseException:
            self._backoff.success()  # the server answered; only the request was wrong
            raise
        finally:
            if conn is not None:
                self._release(conn, healthy)
        self._backoff.success()
        return replies

    def _shm_op(self, work: Callable[[_Conn], list[P.Reply]]) -> list[P.Reply]:
        """`_session(work)`, once more on fresh connections when the server had lost the
        region (a restarted server: every pooled connection is stale, so all are dropped)."""
        try:
            return self._session(work)
        except ShmLost as e:
            logger.info("hicache backend: the server lost our shm region (%s); attaching again", e)
            self.arena.map = None  # a restarted server has a new store (the old mapping is
            # unmapped when the last reader lets it go)
            self._drop_pool()
        try:
            return self._session(work)
        except ShmLost as e:
            raise StorageError(f"the server lost the shm region again: {e}") from e

    def _call(
        self,
        reqs: Sequence[P.Request],
        kind: type[R],
        on_reply: Callable[[int, P.Reply], None] | None = None,
    ) -> list[R]:
        """Round trip under the circuit breaker. Raises `StorageUnavailable` (transient) or
        `StorageError` (an error reply: wrong token, a request the server refused)."""
        replies = self._session(lambda c: c.exchange(reqs, on_reply))
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

    def _get_into(
        self,
        keys: Sequence[str],
        out: Sequence[memoryview],
        landed: Callable[[int, int], None] | None = None,
    ) -> list[int]:
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
                        dst[:] = src
            r.frames = []  # release the received buffers now

        def work(conn: _Conn) -> list[P.Reply]:
            exchange = conn.exchange
            idx = list(range(len(keys)))
            store = self._store_map(conn)
            if store is not None:  # in place from the server's arena; the rest another way
                res[:] = locate_get(exchange, store, keys, views, self.batch_keys, landed)
                idx = [i for i, n in enumerate(res) if n == NOT_MAPPED]
                self.arena.count(reads=len(keys) - len(idx), fallbacks=len(idx))
                if not idx:
                    return []
            region = conn.region
            if region is not None and max((len(views[i]) for i in idx), default=0) <= region.size:
                got = shm_get(exchange, region, [keys[i] for i in idx], [views[i] for i in idx],
                              self.batch_keys, self._shm_request_bytes)
                for i, n in zip(idx, got):
                    res[i] = n
                return []
            tcp_idx[:] = idx
            chunks[:] = split(len(idx), [len(views[i]) for i in idx], self.batch_keys,
                              self.batch_bytes)
            reqs = [P.GetRequest(keys=[keys[idx[j]] for j in c]) for c in chunks]
            return exchange(reqs, copy_out)

        try:
            replies = self._shm_op(work)
            if chunks:  # the TCP path ran
                gets = self._expect(replies, [P.GetRequest()], P.GetReply)
                if [len(r.lengths) for r in gets] != [len(c) for c in chunks]:
                    raise StorageError("reply has the wrong number of pages")
        except StorageError as e:
            self._degraded("get", e)
            return [-1] * len(keys)
        return res

    def batch_set(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        if not keys:
            return []
        views = [byte_view(v) for v in values]
        # A record over the server's frame limit is not sent.
        send = [i for i, v in enumerate(views)
                if not self.max_frame_bytes or len(v) <= self.max_frame_bytes]
        ok = [False] * len(keys)
        index: list[list[int]] = []

        def work(conn: _Conn) -> list[P.Reply]:
            idx = send
            store = self._store_map(conn) if self.arena.writes_wanted else None
            if store is not None:  # straight into the server's arena; the rest another way
                idx = self._store_set(conn, store, keys, views, idx, ok)
                if not idx:
                    return []
            region = conn.region
            if region is not None and max(len(views[i]) for i in idx) <= region.size:
                got = shm_set(
                    conn.exchange,
                    region, [keys[i] for i in idx], [views[i] for i in idx],
                    self.batch_keys, self._shm_request_bytes,
                )
                for i, stored in zip(idx, got):
                    ok[i] = stored
                return []
            # Split by key count and bytes; the parts are pipelined.
            reqs: list[P.SetRequest] = []
            index.clear()
            size = 0
            for i in idx:
                k, v = keys[i], views[i]
                if not reqs or len(index[-1]) >= self.batch_keys or size + len(v) > self.batch_bytes:
                    reqs.append(P.SetRequest())
                    index.append([])
                    size = 0
                reqs[-1].keys.append(k)
                reqs[-1].frames.append(v)
                index[-1].append(i)
                size += len(v)
            return conn.exchange(reqs)

        if send:
            try:
                replies = self._expect(self._shm_op(work), [P.SetRequest()], P.SetReply)
            except StorageError as e:
                self._degraded("set", e)
                replies = []
            for idx, r in zip(index, replies):
                for i, stored in zip(idx, r.stored):
                    ok[i] = stored
        written = sum(len(v) for v, o in zip(views, ok) if o)
        self._count(set_pages=len(keys), set_failures=ok.count(False), bytes_written=written)
        return ok

    def delete(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        try:
            replies = self._call(
                [
                    P.DeleteRequest(keys=list(keys[c.start : c.stop]))
                    for c in split(len(keys), None, self.batch_keys, self.batch_bytes)
                ],
                P.DeleteReply,
            )
        except StorageError:
            self._count(errors=1)
            raise
        self._count(deleted_pages=sum(r.deleted for r in replies))

    def clear(self) -> None:
        try:
            self._call([P.ClearRequest()], P.ClearReply)
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
        if not self._closed and not self._backoff.down:
            try:
                s = self.server_stats()
                pages, nbytes = s.get("pages", -1), s.get("bytes", -1)
            except StorageError as e:
                logger.debug("hicache backend: server stats unavailable: %s", e)
        self._set_gauge(stored_pages=pages, stored_bytes=nbytes)
        return super().stats()

    def close(self) -> None:
        with self._pool_lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, []
            self.arena.map = None
        for conn in pool:
            if conn.region is not None and not self._backoff.down:
                conn.detach(min(self.timeout_ms, 1000))
            conn.close()
        self._ctx.destroy(linger=0)
