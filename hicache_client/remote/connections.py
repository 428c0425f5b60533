"""The `hicache` client's connections: pooled DEALER sockets, each with its shared-memory region
(`shm`), the server's store mapped once (`store`), and the circuit breaker every
round trip runs under. `HiCacheServerBackend` (`backend`) does its work through one
`Connections`; the data paths themselves live in `shm` and `store`.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from hicache_client.backoff import Backoff
from hicache_client.errors import StorageError, StorageUnavailable
from hicache_client.remote import protocol as P
from hicache_client.remote.shm import (
    SHM_REFUSALS,
    ClientRegion,
    Conn,
    HelloLost,
    ShmLost,
    Unreachable,
    Wire,
)
from hicache_client.remote.store import StoreAccess, StoreMap

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

logger = logging.getLogger(__name__)


class Connections:
    """A small pool of connections to one server. Thread-safe: each round trip checks a
    connection out, so concurrent prefetch and backup threads run theirs in parallel."""

    def __init__(self, url: str, token: str, timeout_ms: int, *, shm: bool,
                 shm_bytes: int, populate: bool = True, namespace: bytes = b"",
                 token_proof: str = "auto", server_key: Ed25519PublicKey | None = None) -> None:
        self.url = url
        self.namespace = namespace  # declared on each connection (the server's stats)
        self.timeout_ms = timeout_ms
        self.shm_bytes = shm_bytes
        # Whether new connections offer a region: off by config, or after a server refused one.
        self.shm_enabled = shm
        # The server's shared-memory store, mapped on first use (`store`).
        self.arena = StoreAccess(shm, populate)
        self.backoff = Backoff(f"hicache-server {url}", initial_s=0.05, max_s=2.0)
        self.closed = False
        self._ctx = zmq.Context(io_threads=1)
        self._pool: list[Conn] = []
        self._lock = threading.Lock()
        self._wire = Wire(url, token, timeout_ms, token_proof=token_proof)
        self.server_key = server_key  # the pinned server key: its hello must be signed by it
        self._plain_logged = False

    def _checkout(self) -> Conn:
        with self._lock:
            if self.closed:
                raise StorageUnavailable("hicache backend is closed")
            if self._pool:
                return self._pool.pop()
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        s.setsockopt(zmq.RECONNECT_IVL, 50)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        s.connect(self.url)
        conn = Conn(s, self._wire)
        if (self._wire.token and self._wire.token_proof != "off") or self.server_key is not None:
            try:
                self._hello(conn)
            except BaseException:
                conn.close()
                raise
        if self.namespace:
            try:
                self._bind(conn)
            except BaseException:
                conn.close()
                raise
        if self.shm_enabled:
            try:
                self._attach(conn)
            except BaseException:
                conn.close()
                raise
        return conn

    def _hello(self, conn: Conn) -> None:
        """Start token proofs on `conn`: the server gives it a nonce and proves it holds our
        token (and, with a pinned `server_key`, signs the hello with its key). Raises
        `StorageError` for a server that does not know the token, whose proof is wrong, or
        whose signature does not verify; a server before protocol 7 gets the token as it is
        (unless `token_proof` is "required" or a server key is pinned: then `StorageError`)."""
        w = self._wire
        client_nonce = os.urandom(32)
        tid = P.token_id(w.token) if w.token else ""
        req = P.HelloRequest(token_id=tid, client_nonce=client_nonce.hex())
        reply = conn.exchange([req])[0]
        if isinstance(reply, P.HelloReply):
            try:
                nonce = bytes.fromhex(reply.nonce)
            except ValueError:
                nonce = b""
            if self.server_key is not None:
                self._check_signature(reply, tid, client_nonce, nonce)
            if not w.token or w.token_proof == "off":
                return  # said hello for the server key only: no token to prove
            if len(nonce) >= 16 and reply.proof == "" and w.token_proof != "required":
                # The server checks no token (its auth is off): ours is not needed there.
                if not self._plain_logged:
                    self._plain_logged = True
                    logger.warning("hicache backend: %s checks no auth token (started without "
                                   "--auth-token or --tenants-file)", self.url)
                conn.nonce = nonce
                return
            want = P.server_proof(w.token, nonce, client_nonce)
            if len(nonce) < 16 or not hmac.compare_digest(want, reply.proof):
                raise StorageError(f"{self.url} does not hold our auth token (its hello proof "
                                   "is wrong): not the server configured")
            conn.nonce = nonce
            return
        if not isinstance(reply, P.ErrorReply):
            raise StorageError(f"{self.url} answered {reply.TYPE} to hello")
        if reply.code not in (P.ErrorCode.BAD_VERSION, P.ErrorCode.UNKNOWN_TYPE):
            raise StorageError(f"{self.url} answered {reply.code}: {reply.message}")
        if self.server_key is not None:
            raise StorageError(f"{self.url} predates server keys (protocol 7) and "
                               "server_public_key is set: refused")
        if w.token_proof == "required":
            raise StorageError(f"{self.url} predates token proofs (protocol 7) and token_proof "
                               "is 'required': the token is not sent as it is")
        if not self._plain_logged:
            self._plain_logged = True
            logger.warning("hicache backend: %s predates token proofs (protocol 7): the auth "
                           "token goes as it is", self.url)

    def _check_signature(self, reply: P.HelloReply, tid: str, client_nonce: bytes,
                         nonce: bytes) -> None:
        """Refuse a hello reply not signed by the pinned server key."""
        from hicache_client.remote import identity

        assert self.server_key is not None
        if not reply.signature:
            raise StorageError(f"{self.url} holds no server key (started without --server-key) "
                               "and server_public_key is set: not the server configured")
        data = identity.transcript(tid, client_nonce, nonce, reply.proof)
        if len(nonce) < 16 or not identity.verify(self.server_key, reply.signature, data):
            raise StorageError(f"{self.url} does not hold the server key of server_public_key "
                               "(its hello signature does not verify): not the server "
                               "configured")

    def _bind(self, conn: Conn) -> None:
        """Tell the server this connection's namespace (it counts our misses there); a server
        before protocol 6 does not know the request: nothing to do."""
        reply = conn.exchange([P.BindNamespaceRequest(namespace=self.namespace.hex())])[0]
        if isinstance(reply, P.ErrorReply):
            if reply.code not in (P.ErrorCode.BAD_VERSION, P.ErrorCode.UNKNOWN_TYPE):
                raise StorageError(f"{self.url} answered {reply.code}: {reply.message}")
            self.namespace = b""  # asked once: not again

    def _attach(self, conn: Conn) -> None:
        """Offer the server a new region for `conn`; on a refusal, stay on TCP (log once)."""
        try:
            region = ClientRegion(self.shm_bytes)
        except OSError as e:
            self._no_shm(f"cannot create a region in /dev/shm: {e}")
            return
        try:
            reply = conn.exchange([P.AttachShmRequest(name=region.name, size=region.size)])[0]
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

    def store_map(self, conn: Conn) -> StoreMap | None:
        """The server's store, when this connection has a region (the same host)."""
        if conn.region is None:
            return None
        return self.arena.mapped(lambda req: conn.exchange([req])[0])

    def _no_shm(self, why: str) -> None:
        if self.shm_enabled:
            self.shm_enabled = False
            logger.info("hicache backend: shared memory off, pages go over TCP: %s", why)

    def _release(self, conn: Conn, healthy: bool) -> None:
        with self._lock:
            if healthy and not self.closed:
                self._pool.append(conn)
                return
        conn.close()

    def _drop_pool(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, []
        for conn in pool:
            conn.close()

    def session(self, work: Callable[[Conn], list[P.Reply]]) -> list[P.Reply]:
        """Run `work` on one pooled connection under the circuit breaker. Raises
        `StorageUnavailable` (no answer in time; the connection is dropped), `ShmLost` or
        whatever `work` raises (the server answered: the breaker is closed). A server that
        lost our hello (it restarted) voids every pooled connection: once more on new ones."""
        try:
            return self._session(work)
        except HelloLost as e:
            logger.info("hicache backend: the server lost our hello (%s); saying hello again", e)
            self._drop_pool()
        try:
            return self._session(work)
        except HelloLost as e:
            raise StorageError(f"the server lost our hello again: {e}") from e

    def _session(self, work: Callable[[Conn], list[P.Reply]]) -> list[P.Reply]:
        self.backoff.check()
        healthy = False
        conn: Conn | None = None
        try:
            conn = self._checkout()
            replies = work(conn)
            healthy = True
        except Unreachable as e:
            self.backoff.failure(e)
            raise StorageUnavailable(str(e)) from e
        except BaseException:
            self.backoff.success()  # the server answered; only the request was wrong
            raise
        finally:
            if conn is not None:
                self._release(conn, healthy)
        self.backoff.success()
        return replies

    def shm_op(self, work: Callable[[Conn], list[P.Reply]]) -> list[P.Reply]:
        """`session(work)`, once more on fresh connections when the server had lost the region
        (a restarted server: every pooled connection is stale, so all are dropped)."""
        try:
            return self.session(work)
        except ShmLost as e:
            logger.info("hicache backend: the server lost our shm region (%s); attaching again", e)
            self.arena.map = None  # a restarted server has a new store (the old mapping is
            # unmapped when the last reader lets it go)
            self._drop_pool()
        try:
            return self.session(work)
        except ShmLost as e:
            raise StorageError(f"the server lost the shm region again: {e}") from e

    def close(self) -> None:
        """Detach every region (best effort, unless the server is known down), close. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            pool, self._pool = self._pool, []
            self.arena.map = None
        for conn in pool:
            if conn.region is not None and not self.backoff.down:
                conn.detach(min(self.timeout_ms, 1000))
            conn.close()
        self._ctx.destroy(linger=0)
