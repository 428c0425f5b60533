"""`lmcache`: pages in an LMCache deployment, through the `lmcache` package.

Supported deployment: LMCache's standalone server (`lmcache_server HOST PORT cpu`, URL
`lm://host:port`), the remote store LMCache engines share. We speak its protocol with the
package's own message classes (`lmcache.v1.protocol.ClientMetaMessage` /
`ServerMetaMessage`) and keys (`lmcache.utils.CacheEngineKey`), so what we store is an ordinary
LMCache object: each page record is a `BINARY` object of `uint8` under the key
`hc{namespace[:16]}g{generation}@1@0@{page key}@uint8`. The key's world size and worker id
are always 1 and 0: the page key already names the shard (its chain starts from the namespace
seed, which holds the TP rank where ranks hold different KV, and not for MLA, whose ranks hold
the same KV), so ranks that share pages share objects, and rank 1 of an MLA model reads what
rank 0 wrote.

Why not LMCache's `LMCServerConnector`: it needs an LMCache engine around it (a
`LocalCPUBackend` allocating `MemoryObj`s, an asyncio loop) and keeps one socket behind one lock.
This backend keeps a pool of connections (one per concurrent caller) and pipelines a whole batch
on one connection: every request of the batch goes out in one write, then the replies are read in
order, straight into the caller's buffers.

What the server protocol lacks, and how the backend copes:
- No delete, so `EXIST` cannot tell a deleted page. Each page has a one-byte *presence* object
  beside its record (same key, model field + "p"): `batch_set` writes the record, then
  presence 1; `delete` writes presence 0, then an empty record (a tombstone). `batch_exists`
  reads the presence objects (pipelined `GET`s of one byte: as cheap as `EXIST`), so a delete
  by any instance is seen by all. A get of a tombstone is a miss.
- No clear and no listing: the namespace carries a generation number stored on the server
  (`clear` increments it); objects of older generations become unreachable.
- No eviction and no capacity: the server keeps everything in memory until it restarts
  (tombstoned and old-generation objects too). Size the server host accordingly.
- `PUT` has no reply: a batch of puts ends with a `HEALTH` request whose reply proves that the
  server has taken every put before it on that connection.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import struct
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any, ClassVar
from urllib.parse import urlparse

from hicache_client.backend import Checked, RecordChecker, StorageBackend, StorageConfig, byte_view
from hicache_client.backend_util import check_known_keys, leading_run
from hicache_client.backoff import Backoff
from hicache_client.errors import ConfigError, StorageError, StorageUnavailable

logger = logging.getLogger(__name__)

KNOWN_KEYS = ("url", "connect_timeout_s", "timeout_s", "max_connections", "model_name")
_GEN_BYTES = 8
# Requests sent before their replies are read: bounded, so that the server never blocks on
# replies we are not reading while we block on requests it is not reading.
_WINDOW = 32
_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)
_PRESENT, _ABSENT = b"\x01", b"\x00"


def _lmcache() -> Any:
    """Import the LMCache pieces lazily (heavy; needs `LMCACHE_TRACK_USAGE=false` offline)."""
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    try:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.protocol import (
            ClientCommand,
            ClientMetaMessage,
            ServerMetaMessage,
            ServerReturnCode,
        )
    except ImportError as e:
        raise ConfigError(
            f"lmcache backend needs the lmcache package ({e}); pip install 'hicache[lmcache]'"
        ) from e

    class _NS:
        pass

    ns = _NS()
    ns.torch = torch  # type: ignore[attr-defined]
    ns.CacheEngineKey = CacheEngineKey  # type: ignore[attr-defined]
    ns.MemoryFormat = MemoryFormat  # type: ignore[attr-defined]
    ns.ClientCommand = ClientCommand  # type: ignore[attr-defined]
    ns.ClientMetaMessage = ClientMetaMessage  # type: ignore[attr-defined]
    ns.ServerMetaMessage = ServerMetaMessage  # type: ignore[attr-defined]
    ns.SUCCESS = ServerReturnCode.SUCCESS  # type: ignore[attr-defined]
    return ns


def parse_url(url: str) -> tuple[str, int]:
    u = urlparse(url)
    if u.scheme != "lm" or not u.hostname or not u.port:
        raise ConfigError(
            f"lmcache: url {url!r} is not lm://host:port (the LMCache server is the supported "
            "deployment; see docs/storage-distributed.md for the other LMCache modes)"
        )
    return u.hostname, u.port


class _Conn:
    """One socket to the LMCache server."""

    def __init__(self, host: str, port: int, connect_timeout: float, timeout: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=connect_timeout)
        self.sock.settimeout(timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send_parts(self, parts: list[memoryview | bytes]) -> None:
        """Send header and payload with one `sendmsg` (no concatenating copy)."""
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        while views:
            sent = self.sock.sendmsg(views)
            while views and sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            if views and sent:
                views[0] = views[0][sent:]

    def recv_exact(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            # NOTE: the server writes each reply with its own small send() and leaves Nagle on;
            # with several replies in flight it then waits for our ACK, which Linux delays by
            # up to 40 ms. Acknowledging at once keeps pipelined batches flowing.
            if _QUICKACK is not None:
                self.sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("LMCache server closed the connection")
            got += n

    def recv_bytes(self, n: int) -> bytes:
        buf = bytearray(n)
        self.recv_exact(memoryview(buf))
        return bytes(buf)

    def close(self) -> None:
        with suppress(OSError):
            self.sock.close()


class LMCacheBackend(StorageBackend):
    """Page records as LMCache objects on an LMCache server (`lm://host:port`).

    Extra config: `url` (required, or env `LMCACHE_REMOTE_URL`), `connect_timeout_s` (5),
    `timeout_s` (30), `max_connections` (idle connections kept, 8), `model_name` (the key's
    model field, default "hc" + namespace[:16]).
    """

    name: ClassVar[str] = "lmcache"

    def __init__(self, config: StorageConfig) -> None:
        super().__init__(config)
        check_known_keys(config, KNOWN_KEYS, self.name)
        url = config.get("url") or os.environ.get("LMCACHE_REMOTE_URL", "")
        if not url:
            raise ConfigError("lmcache: set extra config 'url' (lm://host:port)")
        self.host, self.port = parse_url(str(url))
        try:
            self.connect_timeout = float(config.get("connect_timeout_s", 5.0))
            self.timeout = float(config.get("timeout_s", 30.0))
            self.max_connections = int(config.get("max_connections", 8))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"lmcache: bad numeric setting: {e}") from e
        self._lm = _lmcache()
        self._model = str(config.get("model_name") or "hc" + (config.namespace[:16] or "0"))
        if "@" in self._model:
            raise ConfigError("lmcache: model_name must not contain '@'")
        self._pool: list[_Conn] = []
        self._pool_lock = threading.Lock()
        self._closed = False
        self._backoff = Backoff("lmcache", initial_s=0.1, max_s=5.0)
        self._gen_key = self._lm.CacheEngineKey(
            self._model + "-gen", 1, 0, 0, self._lm.torch.uint8
        )
        self._health()  # fail at start-up if the server is not there
        logger.info("lmcache: server %s:%d, model field %s", self.host, self.port, self._model)

    # -- connections and messages ----------------------------------------------------------

    @contextmanager
    def _conn(self) -> Iterator[_Conn]:
        if self._closed:
            raise StorageError("lmcache: backend is closed")
        self._backoff.check()
        with self._pool_lock:
            conn = self._pool.pop() if self._pool else None
        try:
            if conn is None:
                conn = _Conn(self.host, self.port, self.connect_timeout, self.timeout)
            yield conn
        except (OSError, ConnectionError, struct.error) as e:
            if conn is not None:
                conn.close()
            self._count(errors=1)
            self._backoff.failure(e)
            raise StorageUnavailable(f"lmcache: {self.host}:{self.port}: {e}") from e
        except BaseException:
            if conn is not None:
                conn.close()  # the stream may be mid-message: never reuse it
            raise
        self._backoff.success()
        with self._pool_lock:
            if len(self._pool) < self.max_connections and not self._closed:
                self._pool.append(conn)
                return
        conn.close()

    def _request(self, command: Any, key: Any, length: int = 0) -> bytes:
        lm = self._lm
        return bytes(
            lm.ClientMetaMessage(
                command, key, length, lm.MemoryFormat.BINARY, lm.torch.uint8,
                lm.torch.Size([length, 0, 0, 0]),
            ).serialize()
        )

    def _reply(self, conn: _Conn) -> Any:
        return self._lm.ServerMetaMessage.deserialize(
            conn.recv_bytes(self._lm.ServerMetaMessage.packlength())
        )

    def _health(self) -> None:
        with self._conn() as c:
            c.sock.sendall(self._request(self._lm.ClientCommand.HEALTH, self._gen_key))
            if self._reply(c).code != self._lm.SUCCESS:
                raise StorageUnavailable("lmcache: server health check failed")

    def _generation(self, conn: _Conn) -> int:
        conn.sock.sendall(self._request(self._lm.ClientCommand.GET, self._gen_key))
        meta = self._reply(conn)
        if meta.code != self._lm.SUCCESS:
            return 0
        data = conn.recv_bytes(meta.length)
        return int.from_bytes(data[:_GEN_BYTES], "little") if len(data) >= _GEN_BYTES else 0

    def _key(self, key: str, gen: int, presence: bool = False) -> Any:
        """The LMCache key of page `key` (or of its presence object)."""
        try:
            chunk = int(key, 16)
        except ValueError:
            chunk = int.from_bytes(hashlib.sha256(key.encode()).digest(), "big")
        # World size 1, worker 0 on every rank: the page key names the shard (module doc).
        return self._lm.CacheEngineKey(
            f"{self._model}g{gen}{'p' if presence else ''}", 1, 0, chunk, self._lm.torch.uint8,
        )

    def _put_all(self, conn: _Conn, gen: int, keys: Sequence[str],
                 views: Sequence[memoryview], delete: bool = False) -> None:
        """Records then presence 1 per page (`delete`: presence 0 then a tombstone), then a
        `HEALTH` round trip that proves the server has taken them all."""
        put = self._lm.ClientCommand.PUT
        flag = _ABSENT if delete else _PRESENT
        for k, v in zip(keys, views):
            data: list[memoryview | bytes] = [self._request(put, self._key(k, gen), len(v)), v]
            mark: list[memoryview | bytes] = [
                self._request(put, self._key(k, gen, presence=True), 1), flag
            ]
            conn.send_parts(mark + data if delete else data + mark)
        conn.sock.sendall(self._request(self._lm.ClientCommand.HEALTH, self._gen_key))
        if self._reply(conn).code != self._lm.SUCCESS:
            raise ConnectionError("server did not confirm the batch of puts")

    # -- StorageBackend --------------------------------------------------------------------

    def batch_exists(self, keys: Sequence[str]) -> int:
        self._count(exists_calls=1)
        if not keys:
            return 0
        get = self._lm.ClientCommand.GET
        flags: list[bool] = []
        with self._conn() as c:
            gen = self._generation(c)
            for lo in range(0, len(keys), _WINDOW):
                part = keys[lo : lo + _WINDOW]
                c.sock.sendall(b"".join(
                    self._request(get, self._key(k, gen, presence=True)) for k in part))
                for _ in part:
                    meta = self._reply(c)
                    data = c.recv_bytes(meta.length) if meta.code == self._lm.SUCCESS else b""
                    flags.append(data == _PRESENT)
                if not all(flags):
                    break  # the leading run ends in this window
        return leading_run(flags)

    def _get_into(self, keys: Sequence[str], out: Sequence[memoryview]) -> list[int]:
        return [r.length for r in self._read(keys, out, None)]

    def _get_checked(self, keys: Sequence[str], out: Sequence[memoryview]) -> list[Checked]:
        # Records arrive one by one: each is checked (off this thread) while the next arrives.
        return self._read(keys, out, RecordChecker(self, len(keys)))

    def _read(
        self, keys: Sequence[str], out: Sequence[memoryview], checker: RecordChecker | None
    ) -> list[Checked]:
        get = self._lm.ClientCommand.GET
        result: list[int] = []
        with self._conn() as c:
            gen = self._generation(c)
            for i, buf in enumerate(out):
                if i % _WINDOW == 0:
                    part = keys[i : i + _WINDOW]
                    c.sock.sendall(b"".join(self._request(get, self._key(x, gen)) for x in part))
                meta = self._reply(c)
                if meta.code != self._lm.SUCCESS:
                    result.append(-1)
                    continue
                n = int(meta.length)
                dst = byte_view(buf)
                if n == len(dst):
                    c.recv_exact(dst)
                elif n:
                    c.recv_bytes(n)  # wrong size: drained, dropped as corrupt by the caller
                result.append(n if n else -1)  # empty: a tombstone, the page was deleted
                if checker is not None:
                    checker.add(i, keys[i], result[-1], dst)
        if checker is not None:
            return checker.results()
        return [Checked(n, None) for n in result]

    def _set_from(self, keys: Sequence[str], values: Sequence[memoryview]) -> list[bool]:
        views = [byte_view(v) for v in values]
        with self._conn() as c:
            gen = self._generation(c)
            self._put_all(c, gen, keys, views)
        return [True] * len(keys)

    def delete(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        with self._conn() as c:
            gen = self._generation(c)
            self._put_all(c, gen, keys, [memoryview(b"")] * len(keys), delete=True)
        self._count(deleted_pages=len(keys))

    def clear(self) -> None:
        """Move this namespace to a new generation: every page stored so far is unreachable."""
        with self._conn() as c:
            gen = self._generation(c)
            data = (gen + 1).to_bytes(_GEN_BYTES, "little")
            c.sock.sendall(self._request(self._lm.ClientCommand.PUT, self._gen_key, len(data)))
            c.sock.sendall(data)
            c.sock.sendall(self._request(self._lm.ClientCommand.HEALTH, self._gen_key))
            if self._reply(c).code != self._lm.SUCCESS:
                raise ConnectionError("server did not confirm the new generation")
        logger.info("lmcache: cleared namespace %s (generation %d)", self._model, gen + 1)

    def close(self) -> None:
        with self._pool_lock:
            self._closed = True
            conns, self._pool = self._pool, []
        for c in conns:
            c.close()
