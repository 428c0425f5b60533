"""`hicache-server`: a standalone shared page store for several HiCache engine instances.

One ZeroMQ ROUTER socket serves every client; each request is answered in arrival order by one
thread that owns the memory tier (so no request waits on a lock held by another). Persistence,
when enabled, runs in its own write-behind thread (see `storage_backends.server.store`). The
server never parses page records: it stores and returns opaque bytes, and the client validates
each record it reads.
"""

from __future__ import annotations

import hmac
import logging
import os
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import zmq

from hicache_client.remote import protocol as P
from hicache_client.remote.malloc import tune_malloc
from storage_backends.server import admin_ops
from storage_backends.server.arena import Arena, supported
from storage_backends.server.budget import ReplyBudget, cap_reply
from storage_backends.server.cli import (  # noqa: F401 - re-exported
    AUTH_ENV,
    DEFAULT_CLIENT_REPLY_BUDGET,
    DEFAULT_MAX_FRAME,
    DEFAULT_PORT,
    DEFAULT_REPLY_BUDGET,
    ServerConfig,
    build_parser,
    config_from_args,
    parse_size,
)
from storage_backends.server.metrics import Metrics
from storage_backends.server.shm import ShmAttachments, copy_out, records_in
from storage_backends.server.store import nbytes
from storage_backends.server.tenants import Tenant, Tenants
from storage_backends.server.tiers import Tiers

logger = logging.getLogger(__name__)

SERVER_VERSION = "0.1.0"
_KEEP_FRAME_BYTES = 64 << 10
_FRAME_OVERHEAD = 256  # bytes charged per frame of a waiting request (objects, bookkeeping)
# The latency metric's `op` label: a get is a get whichever path its bytes take.
# (A reservation is counted apart: `reserve`; its commit is the set.)
_OP_LABEL = {P.ShmGetRequest.TYPE: "get", P.ShmLocateRequest.TYPE: "get",
             P.ShmSetRequest.TYPE: "set", P.ShmReserveRequest.TYPE: "reserve",
             P.ShmCommitRequest.TYPE: "set"}
# What a tenant's token needs for each request (types not listed need no right); the
# shared-memory store's requests are refused for tenants (it maps every partition's pages).
_RIGHT = {P.ExistsRequest.TYPE: "read", P.GetRequest.TYPE: "read", P.ShmGetRequest.TYPE: "read",
          P.SetRequest.TYPE: "write", P.ShmSetRequest.TYPE: "write",
          P.DeleteRequest.TYPE: "write", P.ClearRequest.TYPE: "clear",
          P.ClearNamespaceRequest.TYPE: "clear"}
MAX_KEY_CHARS = 1024  # longest key a request may name (ours are 64 to 80)
_MAX_SESSIONS = 1 << 16  # connections whose hello nonce is kept (the oldest forgotten first)
_NOT_FOR_TENANTS = {P.MapStoreRequest.TYPE, P.ShmLocateRequest.TYPE, P.ShmReserveRequest.TYPE,
                    P.ShmCommitRequest.TYPE, P.ShmReleaseRequest.TYPE}

class HiCacheServer:
    """The server: `serve_forever()` until `stop()` (or SIGTERM/SIGINT in `main`)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.tiers = Tiers(config, self._make_arena())
        self.store, self.persist = self.tiers.store, self.tiers.persist
        self.budget = ReplyBudget(config.reply_budget_bytes, config.client_reply_budget_bytes)
        self.shm = ShmAttachments(config.shm_max_bytes)
        if self.tiers.arena is not None:
            st = os.stat(self.tiers.arena.path)
            self.shm.forbidden = frozenset({(st.st_dev, st.st_ino)})
        self._tag = ""  # the tenant of the request being run (`_parse`)
        self._token = config.auth_token.encode() if config.auth_token else None
        self._admin_token = config.admin_token.encode() if config.admin_token else None
        self.tenants = (Tenants(config.tenants_file, config.admin_token)
                        if config.tenants_file else None)
        if self.tenants is not None:
            self.tiers.set_partitions(self.tenants.partitions())
            self.budget.set_groups(len(self.tenants.partitions()))
        self._server_key = None  # Ed25519PrivateKey: signs hello replies (--server-key)
        if config.server_key:
            from hicache_client.remote.identity import load_private_key

            self._server_key = load_private_key(config.server_key)
        self._reload_asked = threading.Event()  # SIGHUP: reload the tenants file in the loop
        # Per connection that said hello: [its nonce, the last request id it proved].
        self._sessions: OrderedDict[bytes, list[Any]] = OrderedDict()
        self._auth_off = self._token is None and self.tenants is None
        self._stop = threading.Event()
        # Frame 0 is decoded under these before any token check (docs/security.md, "Limits").
        self.limits = P.DecodeLimits(
            header_bytes=min(config.max_frame_bytes, config.max_header_bytes),
            items=config.max_keys)
        self._ctx = zmq.Context(io_threads=config.io_threads)
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A hard cap far above --max-frame-bytes: frames between the two get an error reply,
        # frames over it make ZeroMQ drop the connection before buffering them.
        self.sock.setsockopt(zmq.MAXMSGSIZE, max(config.max_frame_bytes * 2, 1 << 20))
        self.sock.setsockopt(zmq.RCVHWM, 1000)
        self.sock.setsockopt(zmq.SNDHWM, 1000)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.sock.bind(f"tcp://{config.host}:{config.port}")
        self.port = int(self.sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.connected_clients = 0
        self.counters: dict[str, int] = {
            "requests": 0,
            "error_replies": 0,
            "unauthorized": 0,
            "reply_truncated": 0,
            # Page bytes received (in: set) and sent (out: get) per data path.
            "tcp_page_bytes_in": 0,
            "tcp_page_bytes_out": 0,
            "shm_page_bytes_in": 0,
            "shm_page_bytes_out": 0,
            "store_page_bytes_in": 0,  # written by clients into reserved slots of the store
            "store_page_bytes_out": 0,  # located in the shared-memory store, read in place
        }
        self.metrics: Metrics | None = None
        if config.metrics_port is not None:
            self.metrics = Metrics(self, config.metrics_port)
            self.tiers.metrics = self.metrics
        logger.info(
            "hicache-server %s listening on tcp://%s:%d (capacity %d bytes, auth %s, "
            "persistence %s, max frame %d bytes, shared memory %s, admin API %s%s)",
            SERVER_VERSION,
            config.host,
            self.port,
            config.capacity_bytes,
            "required" if self._token else
            f"per tenant ({len(self.tenants.names())} tenants)" if self.tenants else "off",
            config.persist_dir or "off",
            config.max_frame_bytes,
            f"up to {config.shm_max_bytes} bytes" if self.shm.enabled else "off",
            "on" if self._admin_token else "off",
            f", metrics on 127.0.0.1:{config.metrics_port}" if self.metrics else "",
        )

    def _make_arena(self) -> Arena | None:
        """The shared-memory store, when enabled and possible here (else None: logged)."""
        size = self.config.arena_bytes
        if size <= 0 or self.config.shm_max_bytes <= 0:
            return None
        if self.config.tenants_file:
            # NOTE: a mapped store shows every partition's records (and which are present) to
            # each same-host client: with tenants it is off, and clients read through their
            # own regions (docs/security.md).
            logger.info("shared-memory store off: tenants are configured")
            return None
        if not supported():
            logger.info("shared-memory store off: readers need x86-64 memory ordering")
            return None
        try:
            return Arena(size)
        except (OSError, ValueError) as e:
            logger.warning("shared-memory store off: cannot create its arena: %s", e)
            return None

    # -- loop -------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    def ask_reload(self) -> None:
        """Reload the tenants file before the next request (safe from a signal handler)."""
        self._reload_asked.set()

    def reload_tenants(self) -> tuple[bool, str]:
        """Read the tenants file again, between two requests: the requests answered before
        ran under the old table, every later one runs under the new; stored pages stay (they
        are keyed by partition, not by token)."""
        if self.tenants is None:
            return False, "this server has no tenants file (--tenants-file)"
        ok, summary = self.tenants.reload()
        if ok:
            self.tiers.set_partitions(self.tenants.partitions())
            self.budget.set_groups(len(self.tenants.partitions()))
        return ok, summary

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if self._reload_asked.is_set():
                    self._reload_asked.clear()
                    self.reload_tenants()
                # While replies are held for clients, look often for the written ones (their
                # bytes free room for requests waiting on the budgets).
                events = dict(poller.poll(1 if self.budget.busy else 200))
                if self.budget.busy:
                    self.budget.refresh()
                    self._resume_waiting()
                if self._monitor in events:
                    self._drain_monitor()
                if self.sock in events:
                    self._drain_requests()
        finally:
            self._shutdown()

    def _drain_monitor(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                ev = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if ev["event"] == zmq.EVENT_ACCEPTED:
                self.connected_clients += 1
                logger.debug("client connected (%d now)", self.connected_clients)
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                self.connected_clients = max(0, self.connected_clients - 1)
                logger.debug("client disconnected (%d now)", self.connected_clients)

    def _drain_requests(self) -> None:
        for _ in range(256):  # bounded so the monitor and stop flag are looked at
            try:
                msg = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident = msg[0].bytes
            frames = msg[1:]
            envelope: list[Any] = []
            if len(frames) > 1 and len(frames[0]) == 0:  # a REQ client's empty delimiter
                envelope, frames = [frames[0]], frames[1:]
            t0 = time.perf_counter()
            req = self._parse(frames, ident=ident)
            if self.budget.has_waiting(ident) or not self._fits(ident, req):
                # Wait behind this connection's earlier requests, or for its replies to drain.
                # Kept as received bytes (decoded again when it runs); small frames are copied
                # out of ZeroMQ's shared receive buffers; each frame is charged its overhead.
                kept: Any = [f if len(f) >= _KEEP_FRAME_BYTES else f.bytes for f in frames]
                size = sum(len(f) + _FRAME_OVERHEAD for f in kept)
                if isinstance(req, P.ErrorReply):  # already answered: wait as the reply
                    kept, size = req, len(req.message) + _FRAME_OVERHEAD
                if not self.budget.park(ident, (envelope, kept, t0), size):
                    rid = req.request_id
                    busy = self._error(
                        P.ErrorCode.BUSY,
                        "too many reply bytes held for this connection or in total "
                        "(--client-reply-budget, --reply-budget): read the replies",
                        rid,
                    )
                    self._send(ident, envelope, busy)
                continue
            self._send(ident, envelope, self._run(req, t0, ident))

    def _resume_waiting(self) -> None:
        for ident in self.budget.waiting_idents():
            while True:
                item = self.budget.peek(ident)
                if item is None:
                    break
                envelope, frames, t0 = item
                req = frames if isinstance(frames, P.ErrorReply) else self._parse(frames, True, ident)
                if not self._fits(ident, req, waiting=True):
                    break
                self.budget.unpark(ident)
                self._send(ident, envelope, self._run(req, t0, ident))

    def _fits(self, ident: bytes, req: P.Request | P.ErrorReply, waiting: bool = False) -> bool:
        if not isinstance(req, P.GetRequest):
            return True
        return self.budget.fits(ident, self._reply_size(req.keys), waiting=waiting)

    def _send(self, ident: bytes, envelope: list[Any], reply: P.Reply) -> None:
        frames: list[Any] = list(P.encode(reply))
        if isinstance(reply, P.GetReply) and reply.frames:
            # The last frame is tracked: ZeroMQ frees a message's frames in order once written
            # (or dropped with its connection), so its tracker says when the reply is gone.
            last = zmq.Frame(frames[-1], copy=False, track=True)
            frames[-1] = last
            self.sock.send_multipart([ident, *envelope, *frames], copy=False)
            self.budget.sent(ident, last.tracker, sum(nbytes(f) for f in reply.frames))
            return
        self.sock.send_multipart([ident, *envelope, *frames], copy=False)

    def _shutdown(self) -> None:
        logger.info("shutting down (%d pages in memory)", self.store.pages)
        self.tiers.close()
        self.shm.close()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)
        self._ctx.term()
        if self.metrics is not None:
            self.metrics.httpd.shutdown()
        logger.info("shutdown complete")

    # -- requests ---------------------------------------------------------------------------

    def handle(self, frames: Sequence[Any], ident: bytes = b"") -> P.Reply:
        """Answer one request (its frames after the routing envelope: `zmq.Frame`s or any
        buffers) from connection `ident` at once, outside the reply budgets. Never raises."""
        return self._run(self._parse(frames, ident=ident), time.perf_counter(), ident)

    def _parse(self, frames: Sequence[Any], again: bool = False,
               ident: bytes = b"") -> P.Request | P.ErrorReply:
        """The request, checked (frame sizes, decoding, token, keys); or the error reply
        (`again`: a waiting request decoded once more, not counted twice)."""
        self.counters["requests"] += 0 if again else 1
        try:
            self._check_frames(frames)
            req = P.decode(frames, expect="request", limits=self.limits)
            assert isinstance(req, P.Request)
            tenant = self._check_auth(req, self._token_of(req, ident, again))
            # The request's tenant, for what it runs on next (`_run` follows each `_parse`):
            # a region is its attacher's tenant's alone.
            self._tag = tenant.tag if tenant is not None else ""
            if tenant is not None:
                self._scope(req, tenant)
                if ident:
                    self.budget.assign(ident, tenant.tag)  # its replies count in its share
            self._check_keys(req)
            return req
        except P.ProtocolError as e:
            return self._error(e.code, e.message, e.request_id)
        except Exception as e:  # noqa: BLE001 - a bad request must never stop the server
            rid = P.peek_request_id(frames[0], self.limits) if frames else 0
            return self._internal(e, rid)

    def _run(self, req: P.Request | P.ErrorReply, t0: float, ident: bytes) -> P.Reply:
        op = "invalid"
        if isinstance(req, P.ErrorReply):
            reply: P.Reply = req
        else:
            op = _OP_LABEL.get(req.TYPE, req.TYPE)
            try:
                reply = self._execute(req, ident)
            except P.ProtocolError as e:
                reply = self._error(e.code, e.message, e.request_id)
            except Exception as e:  # noqa: BLE001 - a bad request must never stop the server
                reply = self._internal(e, req.request_id)
        if self.metrics is not None:
            self.metrics.latency.labels(op).observe(time.perf_counter() - t0)
        return reply

    def _internal(self, e: Exception, rid: int) -> P.ErrorReply:
        """The reply to a request the server failed on: its request id echoed, one log line
        (a traceback only at DEBUG: a client must not be able to flood the log)."""
        text = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        logger.error("request %d failed: %s", rid, text, exc_info=logger.isEnabledFor(
            logging.DEBUG))
        return self._error(P.ErrorCode.INTERNAL, text, rid)

    def _page_bytes(self, counter: str, n: int) -> None:
        self.counters[counter] += n
        if self.metrics is not None:
            path, direction = counter.split("_page_bytes_")
            self.metrics.page_bytes.labels(path, direction).inc(n)

    def _error(self, code: str, message: str, request_id: int) -> P.ErrorReply:
        self.counters["error_replies"] += 1
        if self.metrics is not None:
            self.metrics.errors.labels(code).inc()
        logger.debug("error reply %s: %s", code, message)
        return P.ErrorReply(request_id=request_id, code=code, message=message)

    def _check_frames(self, frames: Sequence[Any]) -> None:
        limit = self.config.max_frame_bytes
        if len(frames) > self.config.max_keys + 1:
            raise P.ProtocolError(
                P.ErrorCode.TOO_LARGE,
                f"{len(frames)} frames in one message; at most {self.config.max_keys + 1}",
                P.peek_request_id(frames[0], self.limits),
            )
        for i, f in enumerate(frames):
            n = len(f)
            if n > limit:
                rid = P.peek_request_id(frames[0], self.limits) if i > 0 else 0
                raise P.ProtocolError(
                    P.ErrorCode.TOO_LARGE,
                    f"frame {i} is {n} bytes; --max-frame-bytes is {limit}",
                    rid,
                )

    def _secret(self, tid: str) -> str | None:
        """The token whose `P.token_id` is `tid` (the shared, admin or a tenant's), or None."""
        for token in (self.config.auth_token, self.config.admin_token):
            if token and hmac.compare_digest(P.token_id(token), tid):
                return token
        return self.tenants.secret(tid) if self.tenants is not None else None

    def _hello(self, req: P.HelloRequest, ident: bytes) -> P.HelloReply:
        """Give connection `ident` a fresh nonce for its token proofs, and prove that this
        server holds the token `req` names."""
        rid = req.request_id
        token = self._secret(req.token_id)
        try:
            client_nonce = bytes.fromhex(req.client_nonce)
        except ValueError:
            client_nonce = b""
        if len(client_nonce) < 16:
            raise P.ProtocolError(P.ErrorCode.MALFORMED, "client_nonce: at least 16 bytes, hex",
                                  rid)
        if token is None and not self._auth_off:
            self.counters["unauthorized"] += 1
            raise P.ProtocolError(P.ErrorCode.UNAUTHORIZED, "hello names a token this server "
                                  "does not know (missing or wrong auth token)", rid)
        nonce = os.urandom(32)
        self._sessions[ident] = [nonce, 0]
        self._sessions.move_to_end(ident)
        while len(self._sessions) > _MAX_SESSIONS:
            self._sessions.popitem(last=False)
        # NOTE: a server that checks no data token (no --auth-token, no tenants) proves none:
        # an empty proof tells the client so (its token is not needed here).
        proof = "" if token is None else P.server_proof(token, nonce, client_nonce)
        signature = ""
        if self._server_key is not None:
            from hicache_client.remote import identity

            signature = identity.sign(self._server_key, identity.transcript(
                req.token_id, client_nonce, nonce, proof))
        return P.HelloReply(request_id=rid, nonce=nonce.hex(), proof=proof, signature=signature)

    def _token_of(self, req: P.Request, ident: bytes, again: bool) -> str:
        """The token `req` carries, or proves (`P.request_proof` over this connection's hello
        nonce; each request id used once, rising). Raises `unauthorized` for a wrong proof,
        `hello` when the connection has no hello here (this server restarted)."""
        text = req.token
        if not text.startswith(P.PROOF_PREFIX):
            if text and self.config.require_token_proof and req.TYPE != P.HelloRequest.TYPE:
                self.counters["unauthorized"] += 1
                raise P.ProtocolError(P.ErrorCode.UNAUTHORIZED, "this server takes token "
                                      "proofs only (--require-token-proof): a client of protocol "
                                      "7 or later proves its token without sending it",
                                      req.request_id)
            return text
        rid = req.request_id
        tid, _, mac = text[len(P.PROOF_PREFIX):].partition(":")
        token = self._secret(tid)
        session = self._sessions.get(ident)
        admin = req.TYPE in P.ADMIN_TYPES
        if token is None and (self._admin_token is None if admin else self._auth_off):
            return ""  # no such token is checked here (`_check_auth` says what is off)
        if token is None:
            self.counters["unauthorized"] += 1
            raise P.ProtocolError(P.ErrorCode.UNAUTHORIZED, f"missing or wrong "
                                  f"{'admin' if admin else 'auth'} token (the proof names a "
                                  "token this server does not know)", rid)
        if session is None:
            raise P.ProtocolError(P.ErrorCode.HELLO, "no hello on this connection (the server "
                                  "restarted or forgot it): say hello again", rid)
        nonce, last = session
        if not hmac.compare_digest(P.request_proof(token, nonce, rid, req.TYPE), text) \
                or (not again and rid <= last):
            self.counters["unauthorized"] += 1
            raise P.ProtocolError(P.ErrorCode.UNAUTHORIZED, "wrong token proof (or a request id "
                                  "used before on this connection)", rid)
        if not again:
            session[1] = rid
        return token

    def _check_auth(self, req: P.Request, token: str) -> Tenant | None:
        """Refuse a request without the token it needs (`token`: the one it carries or
        proves); the tenant of its token (None: no tenants file, or an admin request)."""
        if req.TYPE == P.HelloRequest.TYPE:
            return None  # it carries no token: it names one (`_hello`)
        # NOTE: the version-1 `clear` empties every namespace: with an admin token it is the
        # admin's alone (the data token is refused), like the admin API's `admin_clear`. A
        # tenant's clear empties its own partition only (`_scope`).
        if req.TYPE in P.ADMIN_TYPES or (req.TYPE == "clear" and self._admin_token is not None
                                         and self.tenants is None):
            if self._admin_token is None:
                self.counters["unauthorized"] += 1
                raise P.ProtocolError(P.ErrorCode.UNAUTHORIZED, "the admin API is off: start "
                                      "hicache-server with --admin-token", req.request_id)
            if not hmac.compare_digest(token.encode(), self._admin_token):
                self.counters["unauthorized"] += 1
                what = ("clear empties every namespace: it takes the admin token "
                        "(--admin-token), not the data token") if req.TYPE == "clear" \
                    else "missing or wrong admin token"
                raise P.ProtocolError(P.ErrorCode.UNAUTHORIZED, what, req.request_id)
            return None
        if self.tenants is not None:
            tenant = self.tenants.lookup(token)
            if tenant is None:
                self.counters["unauthorized"] += 1
                raise P.ProtocolError(P.ErrorCode.UNAUTHORIZED, "missing or unknown tenant token "
                                      "(this server has a tenants file)", req.request_id)
            return tenant
        if self._token is None:
            return None
        if not hmac.compare_digest(token.encode(), self._token):
            self.counters["unauthorized"] += 1
            raise P.ProtocolError(
                P.ErrorCode.UNAUTHORIZED, "missing or wrong auth token", req.request_id
            )
        return None

    def _scope(self, req: P.Request, tenant: Tenant) -> None:
        """Bind a tenant's request to its partition: refuse what its rights do not allow and
        the shared-memory store; name its keys as stored (`Tenant.keys`)."""
        rid = req.request_id
        right = _RIGHT.get(req.TYPE)
        if right is not None and right not in tenant.rights:
            self.counters["forbidden"] = self.counters.get("forbidden", 0) + 1
            raise P.ProtocolError(P.ErrorCode.FORBIDDEN, f"tenant {tenant.name!r} has no "
                                  f"{right!r} right ({req.TYPE})", rid)
        if req.TYPE in _NOT_FOR_TENANTS:
            raise P.ProtocolError(P.ErrorCode.NO_SHM, "the shared-memory store is off for "
                                  "tenants: read and write through your own region", rid)
        keys = getattr(req, "keys", None)
        if keys:
            req.keys = tenant.keys(keys)  # type: ignore[attr-defined]
        req.tenant = tenant  # type: ignore[attr-defined]

    def _check_keys(self, req: P.Request) -> None:
        rid = req.request_id
        keys: list[str] = getattr(req, "keys", [])
        # Records named: by key, or only by length (a reservation).
        n = max(len(keys), len(getattr(req, "lengths", ())), len(getattr(req, "reserve", ())))
        if n > self.config.max_keys:
            raise P.ProtocolError(
                P.ErrorCode.TOO_LARGE, f"{n} records; at most {self.config.max_keys}", rid
            )
        if any(len(k) > MAX_KEY_CHARS for k in keys):
            # A key is held beside its page and not counted against --capacity: bounded so
            # that it stays small beside any record (4 MiB keys of empty pages had made 100
            # pages hold 403 MiB that stats showed as 0 bytes).
            raise P.ProtocolError(P.ErrorCode.TOO_LARGE, f"a key of more than {MAX_KEY_CHARS} "
                                  "characters", rid)
        if isinstance(req, P.GetRequest) and len(set(keys)) != len(keys):
            # Each key's page would be sent once per mention: refused, not multiplied.
            raise P.ProtocolError(P.ErrorCode.MALFORMED, "a key is repeated in one get", rid)

    def _execute(self, req: P.Request, ident: bytes) -> P.Reply:
        rid = req.request_id
        keys: list[str] = getattr(req, "keys", [])
        if isinstance(req, P.GetRequest):
            return self._get(rid, keys, ident)
        if isinstance(req, P.SetRequest):
            self._page_bytes("tcp_page_bytes_in", sum(len(f) for f in req.frames))
            return self._set(rid, keys, req.frames)
        if isinstance(req, (P.ShmReserveRequest, P.ShmCommitRequest)):
            self._arena(rid, req.arena_id)
            ttl_ms = int(self.tiers.reservations.ttl_s * 1000)
            if isinstance(req, P.ShmReserveRequest):
                offsets, gens = self.tiers.reserve(ident, req.lengths)
                return P.ShmReserveReply(request_id=rid, offsets=offsets, gens=gens,
                                         expires_ms=ttl_ms)
            stored, n = self.tiers.commit(ident, keys, req.offsets)
            self._page_bytes("store_page_bytes_in", n)
            offsets, gens = self.tiers.reserve(ident, req.reserve)
            return P.ShmCommitReply(request_id=rid, stored=stored, offsets=offsets, gens=gens,
                                    expires_ms=ttl_ms)
        if isinstance(req, P.ShmLocateRequest):
            arena = self._arena(rid, req.arena_id)
            offsets, lengths, gens = self.tiers.locate(keys, ident)
            self._page_bytes("store_page_bytes_out",
                             sum(n for n, o in zip(lengths, offsets) if o >= 0))
            return P.ShmLocateReply(request_id=rid, arena_id=arena.id,
                                    offsets=offsets, lengths=lengths, gens=gens)
        if isinstance(req, P.MapStoreRequest):
            arena = self._arena(rid)
            return P.MapStoreReply(request_id=rid, name=arena.name, size=arena.size,
                                   arena_id=arena.id)
        if isinstance(req, P.ShmGetRequest):
            region = self.shm.region(ident, rid, self._tag)
            lengths = copy_out(region, req, self.tiers.lookup(keys, ident), self.tiers.view)
            self._page_bytes("shm_page_bytes_out", sum(
                n for n, c in zip(lengths, req.capacities) if 0 <= n <= c
            ))
            return P.ShmGetReply(request_id=rid, lengths=lengths)
        if isinstance(req, P.ShmSetRequest):
            region = self.shm.region(ident, rid, self._tag)
            records = records_in(region, req, self.config.max_frame_bytes)
            self._page_bytes("shm_page_bytes_in", sum(req.lengths))
            return P.SetReply(request_id=rid, stored=self.tiers.set(keys, records, transient=True))
        if isinstance(req, P.AttachShmRequest):
            self.shm.attach(ident, req.name, req.size, rid, self._tag)
            return P.AttachShmReply(request_id=rid)
        if isinstance(req, P.DetachShmRequest):
            self.shm.detach(ident)
            self.tiers.reservations.drop(ident)
            self.tiers.store.release(ident)
            return P.DetachShmReply(request_id=rid)
        if isinstance(req, P.ExistsRequest):
            return P.ExistsReply(request_id=rid, count=self.tiers.exists(keys))
        if isinstance(req, P.DeleteRequest):
            return P.DeleteReply(request_id=rid, deleted=self.tiers.delete(keys))
        tenant: Tenant | None = getattr(req, "tenant", None)
        if tenant is not None and isinstance(req, (P.ClearRequest, P.ClearNamespaceRequest,
                                                   P.StatsRequest)):
            return self._tenant_op(req, tenant)
        if isinstance(req, P.ClearRequest):
            self.tiers.clear()
            logger.info("cleared by a client")
            return P.ClearReply(request_id=rid)
        if isinstance(req, P.ClearNamespaceRequest):
            n = self.tiers.clear_namespace(bytes.fromhex(req.namespace))
            logger.info("namespace %s… cleared by a client (%d pages)", req.namespace[:16], n)
            return P.ClearNamespaceReply(request_id=rid, deleted=n)
        if isinstance(req, P.StatsRequest):
            return P.StatsReply(request_id=rid, stats=self.stats())
        if isinstance(req, P.PingRequest):
            return P.PingReply(
                request_id=rid,
                server_version=SERVER_VERSION,
                protocol_version=P.PROTOCOL_VERSION,
                max_frame_bytes=self.config.max_frame_bytes,
            )
        if isinstance(req, P.HelloRequest):
            return self._hello(req, ident)
        if isinstance(req, P.ReloadTenantsRequest):
            ok, summary = self.reload_tenants()
            if not ok:
                raise P.ProtocolError(P.ErrorCode.MALFORMED, summary, rid)
            logger.info("admin: tenants reloaded")
            return P.ReloadTenantsReply(request_id=rid, summary=summary)
        reply = admin_ops.execute(self, req, ident)
        if reply is None:
            raise P.ProtocolError(P.ErrorCode.UNKNOWN_TYPE, f"no handler for {req.TYPE}", rid)
        return reply

    def _tenant_op(self, req: P.Request, tenant: Tenant) -> P.Reply:
        """A tenant's clear, namespace clear and stats: of its own partition only."""
        rid = req.request_id
        if isinstance(req, P.StatsRequest):
            totals = self.tiers.store.namespace_totals(partition=tenant.tag).values()
            return P.StatsReply(request_id=rid, stats={"pages": sum(p for p, _ in totals),
                                                       "bytes": sum(b for _, b in totals),
                                                       "max_bytes": tenant.max_bytes})
        ns = bytes.fromhex(req.namespace) if isinstance(req, P.ClearNamespaceRequest) else None
        n = self.clear_partition(tenant, ns)
        logger.info("tenant %s cleared %s of its partition (%d pages)", tenant.name,
                    f"namespace {ns.hex()[:16]}…" if ns else "all", n)
        if isinstance(req, P.ClearNamespaceRequest):
            return P.ClearNamespaceReply(request_id=rid, deleted=n)
        return P.ClearReply(request_id=rid)

    def clear_partition(self, tenant: Tenant, namespace: bytes | None) -> int:
        """Drop `tenant`'s partition's pages (of record `namespace` only, unless None), in
        memory and on disk, and their pins; how many (the larger tier's count)."""
        tiers, tag = self.tiers, tenant.tag
        ns = namespace.hex() if namespace is not None else None
        if len(tiers.pins):
            tiers.pins.unpin(tiers.pinned_keys(ns, tag))
        n = tiers.store.clear_namespace(namespace, tag)
        if tiers.persist is not None:
            n = max(n, tiers.persist.clear_namespace(namespace, tag))
        return n

    def _arena(self, rid: int, arena_id: int | None = None) -> Arena:
        """The store's arena (that the client has mapped, when it names one)."""
        if self.tiers.arena is None:
            raise P.ProtocolError(P.ErrorCode.NO_SHM, "this server has no shared-memory store "
                                  "(--no-shm, --shm-store-bytes 0, or not x86-64)", rid)
        if arena_id is not None and arena_id != self.tiers.arena.id:
            raise P.ProtocolError(P.ErrorCode.NO_SHM, "the shared-memory store changed "
                                  "(the server restarted): map it again", rid)
        return self.tiers.arena

    def _reply_size(self, keys: list[str]) -> int:
        """Bytes of the reply `_get(keys)` would send (no side effects)."""
        return cap_reply(self.tiers.sizes(keys), self.budget.per_client_bytes)[1]

    def _get(self, rid: int, keys: list[str], ident: bytes = b"") -> P.GetReply:
        values = self.tiers.lookup(keys, ident)
        # One reply carries at most --client-reply-budget bytes: the pages past it are answered
        # as absent (misses), so that one reply always fits the budget.
        lengths, _ = cap_reply([-1 if v is None else nbytes(v) for v in values],
                          self.budget.per_client_bytes)
        if any(n < 0 and v is not None for n, v in zip(lengths, values)):
            self.counters["reply_truncated"] += 1
        frames = [self.tiers.frame(v) for v, n in zip(values, lengths) if n >= 0 and v is not None]
        self._page_bytes("tcp_page_bytes_out", sum(n for n in lengths if n > 0))
        return P.GetReply(request_id=rid, lengths=lengths, frames=frames)

    def _set(self, rid: int, keys: list[str], frames: list[Any]) -> P.SetReply:
        # NOTE: a large received frame is stored as is (a zmq.Frame: replies send it again with
        # no copy, by reference count). A small one is copied out: ZeroMQ may carve small
        # messages out of a shared receive buffer, which a kept frame would pin, so the bytes
        # held would exceed the bytes counted against --capacity.
        frames = [bytes(f) if len(f) < _KEEP_FRAME_BYTES else f for f in frames]
        return P.SetReply(request_id=rid, stored=self.tiers.set(keys, frames, transient=False))

    def stats(self) -> dict[str, int]:
        return {
            **self.tiers.stats(),
            "connected_clients": self.connected_clients,
            **self.counters,
            **self.budget.counters(),
            **self.shm.counters,
            "shm_regions": len(self.shm),
            "shm_mapped_bytes": self.shm.mapped_bytes,
        }


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    config, log_level = config_from_args(list(argv) if argv is not None else None)
    logging.basicConfig(
        level=getattr(logging, log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    tune_malloc()
    os.umask(os.umask(0o077) | 0o077)  # what it persists is private (docs/security.md)
    try:
        server = HiCacheServer(config)
    except (ValueError, OSError, zmq.ZMQError) as e:  # a bad file or address: one line, exit 2
        import sys

        text = " ".join(str(e).split())[:500]
        print(f"hicache-server: error: {text}", file=sys.stderr)
        return 2

    def _on_signal(signum: int, _frame: object) -> None:
        logger.info("received %s", signal.Signals(signum).name)
        server.stop()

    def _on_hup(_signum: int, _frame: object) -> None:
        logger.info("received SIGHUP: reloading the tenants file")
        server.ask_reload()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGHUP, _on_hup)
    server.serve_forever()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

