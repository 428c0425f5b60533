"""`hicache-server`: a standalone shared page store for several HiCache engine instances.

One ZeroMQ ROUTER socket serves every client; each request is answered in arrival order by one
thread that owns the memory tier (so no request waits on a lock held by another). Persistence,
when enabled, runs in its own write-behind thread (see `storage_backends.server.store`). The
server never parses page records: it stores and returns opaque bytes, and the client validates
each record it reads.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from storage_backends.server import protocol as P
from storage_backends.server.store import PageStore, Value, WriteBehind, nbytes, tune_malloc

logger = logging.getLogger(__name__)

SERVER_VERSION = "0.1.0"
AUTH_ENV = "HICACHE_SERVER_AUTH_TOKEN"
DEFAULT_PORT = 7480
DEFAULT_MAX_FRAME = 64 << 20
_KEEP_FRAME_BYTES = 64 << 10

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(text: str) -> int:
    """Bytes in `text`: `4096`, `512MiB`, `8GiB`, `1TiB` (binary), `8GB` (decimal), `8G` (binary)."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 512MiB, 8GiB, 1TiB)")
    number, unit, binary, b = m.groups()
    unit = unit.lower()
    if binary and not unit:
        raise ValueError(f"not a size: {text!r}")
    decimal = bool(unit) and bool(b) and not binary  # "8GB"
    base = 1000 if decimal else 1024
    value = float(number) * base ** _POWERS[unit]
    if value != int(value):
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(value)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    capacity_bytes: int = 8 << 30
    persist_dir: str | None = None
    persist_queue: int = 4096
    persist_block_ms: int = 100
    persist_capacity_bytes: int = 0
    auth_token: str | None = None
    max_frame_bytes: int = DEFAULT_MAX_FRAME
    max_keys: int = 65536
    metrics_port: int | None = None
    io_threads: int = 2


class _Metrics:
    """Prometheus metrics of one server (a private registry, exported on --metrics-port)."""

    def __init__(self, server: HiCacheServer, port: int) -> None:
        import prometheus_client as pc

        reg = pc.CollectorRegistry()
        self.registry = reg
        store = server.store
        pages = pc.Gauge("hicache_server_pages", "Pages held in memory", registry=reg)
        pages.set_function(lambda: store.pages)
        nbytes = pc.Gauge("hicache_server_bytes", "Bytes of pages held in memory", registry=reg)
        nbytes.set_function(lambda: store.bytes)
        cap = pc.Gauge("hicache_server_capacity_bytes", "Memory tier capacity", registry=reg)
        cap.set(server.config.capacity_bytes)
        clients = pc.Gauge("hicache_server_connected_clients", "Connected clients", registry=reg)
        clients.set_function(lambda: server.connected_clients)
        self.hits = pc.Counter("hicache_server_hits", "Pages found by get", registry=reg)
        self.misses = pc.Counter("hicache_server_misses", "Pages get did not find", registry=reg)
        self.evictions = pc.Counter(
            "hicache_server_evictions", "Pages evicted from memory (LRU)", registry=reg
        )
        self.errors = pc.Counter(
            "hicache_server_errors", "Error replies by code", ["code"], registry=reg
        )
        self.latency = pc.Histogram(
            "hicache_server_request_seconds",
            "Request handling latency by op",
            ["op"],
            buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1),
            registry=reg,
        )
        if server.persist is not None:
            wb = server.persist
            pend = pc.Gauge(
                "hicache_server_persist_pending", "Pages waiting to be persisted", registry=reg
            )
            pend.set_function(lambda: wb.pending)
            self.persist_dropped = pc.Counter(
                "hicache_server_persist_dropped",
                "Pages not persisted because the write-behind queue was full",
                registry=reg,
            )
        self.httpd, self.thread = pc.start_http_server(port, addr="127.0.0.1", registry=reg)


class HiCacheServer:
    """The server: `serve_forever()` until `stop()` (or SIGTERM/SIGINT in `main`)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.store = PageStore(config.capacity_bytes)
        self.persist: WriteBehind | None = None
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
        self._token = config.auth_token.encode() if config.auth_token else None
        self._stop = threading.Event()
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
        }
        self.metrics: _Metrics | None = None
        if config.metrics_port is not None:
            self.metrics = _Metrics(self, config.metrics_port)
        logger.info(
            "hicache-server %s listening on tcp://%s:%d (capacity %d bytes, auth %s, "
            "persistence %s, max frame %d bytes%s)",
            SERVER_VERSION,
            config.host,
            self.port,
            config.capacity_bytes,
            "required" if self._token else "off",
            config.persist_dir or "off",
            config.max_frame_bytes,
            f", metrics on 127.0.0.1:{config.metrics_port}" if self.metrics else "",
        )

    # -- loop -------------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(200))
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
            ident = msg[0]
            frames = msg[1:]
            envelope: list[Any] = []
            if len(frames) > 1 and len(frames[0]) == 0:  # a REQ client's empty delimiter
                envelope, frames = [frames[0]], frames[1:]
            reply = self.handle(frames)
            self.sock.send_multipart([ident, *envelope, *P.encode(reply)], copy=False)

    def _shutdown(self) -> None:
        logger.info("shutting down (%d pages in memory)", self.store.pages)
        if self.persist is not None:
            n = self.persist.close()
            logger.info("persistence flushed (%d pages written)", n)
        self._monitor.close(linger=0)
        self.sock.close(linger=0)
        self._ctx.term()
        if self.metrics is not None:
            self.metrics.httpd.shutdown()
        logger.info("shutdown complete")

    # -- requests ---------------------------------------------------------------------------

    def handle(self, frames: Sequence[Any]) -> P.Reply:
        """Answer one request (its frames after the routing envelope: `zmq.Frame`s or any
        buffers). Never raises."""
        t0 = time.perf_counter()
        self.counters["requests"] += 1
        op = "invalid"
        try:
            self._check_frames(frames)
            req = P.decode(frames, expect="request")
            op = req.TYPE
            assert isinstance(req, P.Request)
            self._check_auth(req)
            reply = self._execute(req)
        except P.ProtocolError as e:
            reply = self._error(e.code, e.message, e.request_id)
        except Exception as e:  # noqa: BLE001 - a bad request must never stop the server
            logger.exception("request failed")
            reply = self._error(P.ErrorCode.INTERNAL, f"{type(e).__name__}: {e}", 0)
        if self.metrics is not None:
            self.metrics.latency.labels(op).observe(time.perf_counter() - t0)
        return reply

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
                P.peek_request_id(frames[0]),
            )
        for i, f in enumerate(frames):
            n = len(f)
            if n > limit:
                rid = P.peek_request_id(frames[0]) if i > 0 else 0
                raise P.ProtocolError(
                    P.ErrorCode.TOO_LARGE,
                    f"frame {i} is {n} bytes; --max-frame-bytes is {limit}",
                    rid,
                )

    def _check_auth(self, req: P.Request) -> None:
        if self._token is None:
            return
        if not hmac.compare_digest(req.token.encode(), self._token):
            self.counters["unauthorized"] += 1
            raise P.ProtocolError(
                P.ErrorCode.UNAUTHORIZED, "missing or wrong auth token", req.request_id
            )

    def _execute(self, req: P.Request) -> P.Reply:
        rid = req.request_id
        keys: list[str] = getattr(req, "keys", [])
        if len(keys) > self.config.max_keys:
            raise P.ProtocolError(
                P.ErrorCode.TOO_LARGE, f"{len(keys)} keys; at most {self.config.max_keys}", rid
            )
        if isinstance(req, P.GetRequest):
            return self._get(rid, keys)
        if isinstance(req, P.SetRequest):
            return self._set(rid, keys, req.frames)
        if isinstance(req, P.ExistsRequest):
            return P.ExistsReply(request_id=rid, count=self._exists(keys))
        if isinstance(req, P.DeleteRequest):
            n = self.store.delete(keys)
            if self.persist is not None:
                n = max(n, self.persist.delete(keys))
            return P.DeleteReply(request_id=rid, deleted=n)
        if isinstance(req, P.ClearRequest):
            self.store.clear()
            if self.persist is not None:
                self.persist.clear()
            logger.info("cleared by a client")
            return P.ClearReply(request_id=rid)
        if isinstance(req, P.StatsRequest):
            return P.StatsReply(request_id=rid, stats=self.stats())
        if isinstance(req, P.PingRequest):
            return P.PingReply(
                request_id=rid,
                server_version=SERVER_VERSION,
                protocol_version=P.PROTOCOL_VERSION,
                max_frame_bytes=self.config.max_frame_bytes,
            )
        raise P.ProtocolError(P.ErrorCode.UNKNOWN_TYPE, f"no handler for {req.TYPE}", rid)

    def _exists(self, keys: list[str]) -> int:
        flags = self.store.exists(keys)
        run = 0
        for key, in_memory in zip(keys, flags):
            # A page may be in memory only (its persistence dropped) or on disk only (evicted
            # from memory, or not read back since a restart): either counts.
            if not in_memory and (self.persist is None or not self.persist.exists([key])[0]):
                break
            run += 1
        return run

    def _get(self, rid: int, keys: list[str]) -> P.GetReply:
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
        frames = [v for v in values if v is not None]
        lengths = [-1 if v is None else nbytes(v) for v in values]
        return P.GetReply(request_id=rid, lengths=lengths, frames=frames)

    def _put_memory(self, key: str, value: Value, *, persist: bool, deadline: float = 0.0) -> bool:
        ok, evicted = self.store.put(key, value)
        if evicted:
            logger.debug("evicted %d pages", len(evicted))
            if self.metrics is not None:
                self.metrics.evictions.inc(len(evicted))
        if (
            ok
            and persist
            and self.persist is not None
            and not self.persist.enqueue(key, value, deadline)
            and self.metrics is not None
        ):
            self.metrics.persist_dropped.inc()
        return ok

    def _set(self, rid: int, keys: list[str], frames: list[Any]) -> P.SetReply:
        # NOTE: a large received frame is stored as is (a zmq.Frame: replies send it again with
        # no copy, by reference count). A small one is copied out: ZeroMQ may carve small
        # messages out of a shared receive buffer, which a kept frame would pin, so the bytes
        # held would exceed the bytes counted against --capacity.
        frames = [bytes(f) if len(f) < _KEEP_FRAME_BYTES else f for f in frames]
        # Overwrites never go back in time: the older persisted copies are removed before the
        # new values are acknowledged (a key whose old file stays is refused, keeping its old
        # value everywhere). Whatever then happens to the new value's write (queue full, disk
        # full, crash), a later read finds the new value or nothing.
        fresh = self.persist.supersede(keys) if self.persist is not None else [True] * len(keys)
        # One wait budget per request for room in a full write-behind queue (back pressure).
        deadline = time.monotonic() + self.config.persist_block_ms / 1000.0
        stored = [
            ok and self._put_memory(k, v, persist=True, deadline=deadline)
            for k, v, ok in zip(keys, frames, fresh)
        ]
        return P.SetReply(request_id=rid, stored=stored)

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
            "connected_clients": self.connected_clients,
            **self.counters,
        }
        if self.persist is not None:
            out.update({f"persist_{k}": v for k, v in self.persist.counters().items()})
        return out


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hicache-server",
        description="Shared L3 page store for HiCache engines (ZeroMQ + msgpack). Engines use it "
        "with --hicache-storage-backend hicache.",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; bind another address only on a trusted "
        "network, and set --auth-token)",
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port (default %(default)s)")
    p.add_argument(
        "--capacity",
        type=_size,
        default="8GiB",
        help="memory tier capacity: 512MiB, 8GiB, 1TiB, 8GB (decimal) or bytes; least recently "
        "used pages are evicted beyond it (default 8GiB)",
    )
    p.add_argument(
        "--persist-dir",
        default=None,
        help="directory to persist pages to (the `file` backend's layout); a restarted server "
        "serves every page written before a clean shutdown. Default: memory only",
    )
    p.add_argument(
        "--persist-queue",
        type=int,
        default=4096,
        help="write-behind queue length in pages (default %(default)s); when full, a set waits "
        "up to --persist-block-ms, then the page is kept in memory only and counted as dropped",
    )
    p.add_argument(
        "--persist-block-ms",
        type=int,
        default=100,
        help="how long a set may wait for room in a full write-behind queue (default %(default)s)",
    )
    p.add_argument(
        "--persist-capacity",
        type=_size,
        default="0",
        help="byte cap of the persisted pages, LRU-evicted beyond it (default 0: no cap)",
    )
    p.add_argument(
        "--auth-token",
        default=None,
        help=f"shared token every request must carry (default: env {AUTH_ENV}; unset = no auth). "
        "Prefer the environment variable: command lines are visible to other users",
    )
    p.add_argument(
        "--max-frame-bytes",
        type=_size,
        default=str(DEFAULT_MAX_FRAME),
        help="largest frame (one page record or a request header) accepted; larger ones get a "
        "too_large error reply (default 64MiB)",
    )
    p.add_argument(
        "--max-keys",
        type=int,
        default=65536,
        help="most keys in one request (default %(default)s)",
    )
    p.add_argument(
        "--io-threads",
        type=int,
        default=2,
        help="ZeroMQ I/O threads (socket reads and writes run there, outside the GIL); more "
        "help with many clients moving large pages (default %(default)s)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on http://127.0.0.1:PORT/metrics (default: off)",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default %(default)s)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    tune_malloc()
    token = args.auth_token if args.auth_token is not None else os.environ.get(AUTH_ENV) or None
    config = ServerConfig(
        host=args.host,
        port=args.port,
        capacity_bytes=args.capacity,
        persist_dir=args.persist_dir,
        persist_queue=args.persist_queue,
        persist_block_ms=args.persist_block_ms,
        persist_capacity_bytes=args.persist_capacity,
        auth_token=token,
        max_frame_bytes=args.max_frame_bytes,
        max_keys=args.max_keys,
        metrics_port=args.metrics_port,
        io_threads=args.io_threads,
    )
    server = HiCacheServer(config)

    def _on_signal(signum: int, _frame: object) -> None:
        logger.info("received %s", signal.Signals(signum).name)
        server.stop()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    server.serve_forever()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
