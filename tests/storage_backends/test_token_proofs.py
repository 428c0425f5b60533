"""Token proofs (protocol 7 `hello`) and what crosses the wire: a relay between a client and a
real `hicache-server` records every byte both ways (the loopback capture), and neither the token
nor a page's bytes (sealed records) appear in it; a proof cannot be replayed or moved to another
connection; a server that does not hold the token is refused at start-up; a restarted server
gets a new hello; `--require-token-proof` refuses tokens sent as they are, naming why; an older
server gets the token as it is, unless `token_proof` is "required"."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from hicache_client.errors import ConfigError
from hicache_client.remote import protocol as P
from tests.procs import free_port
from tests.storage_backends.conftest import buffers
from tests.storage_backends.hicache_server_proc import (
    HiCacheServerProc,
    OldProtocolServer,
    RawClient,
    client_of,
    hicache_server,
    pages,
)
from tests.storage_backends.test_tenants import ADMIN, TOK_A, TOK_B, tenants_server

KEY = "44" * 32
N = 4


class Relay:
    """A TCP relay on a free loopback port to `port`, keeping every byte it passes."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.bytes = bytearray()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.listener.accept()
            except OSError:
                return
            b = socket.create_connection(("127.0.0.1", self.target))
            self._socks += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(1 << 20)
            except OSError:
                data = b""
            if not data:
                for s in (src, dst):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)
                return
            with self._lock:
                self.bytes += data
            dst.sendall(data)

    def captured(self) -> bytes:
        with self._lock:
            return bytes(self.bytes)

    def close(self) -> None:
        self.listener.close()
        for s in self._socks:
            s.close()


@pytest.fixture(name="tenants_server")
def _tenants_server(tmp_path: Path) -> Iterator[HiCacheServerProc]:
    with tenants_server(tmp_path) as srv:
        yield srv


def test_no_token_and_no_page_byte_crosses_the_wire(tenants_server: HiCacheServerProc) -> None:
    relay = Relay(tenants_server.port)
    keys, recs = pages("wire", N, 64 << 10)
    b = client_of(relay.url, TOK_A, encryption_key=KEY, shm=False)
    try:
        assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * N
        out = buffers(N, len(recs[0]))
        assert b.batch_get(keys, out) == [True] * N
        assert [bytes(o) for o in out] == [bytes(r) for r in recs]
        assert b.batch_exists(keys) == N
    finally:
        b.close()
        relay.close()
    wire = relay.captured()
    # The capture holds the traffic (keys travel in the clear, as documented) ...
    assert len(wire) > N * (64 << 10) * 2
    assert all(k.encode() in wire for k in keys)
    # ... and no token, and no run of any page's payload.
    assert TOK_A.encode() not in wire
    for rec in recs:
        for at in range(128, len(rec) - 64, 8192):
            assert bytes(rec[at:at + 64]) not in wire


def test_a_proof_is_good_once_and_on_its_own_connection(
        tenants_server: HiCacheServerProc) -> None:
    a, other = RawClient(tenants_server.url), RawClient(tenants_server.url)
    try:
        client_nonce = os.urandom(32)
        hello = a.call(P.HelloRequest(token_id=P.token_id(TOK_A), client_nonce=client_nonce.hex()))
        assert isinstance(hello, P.HelloReply)
        nonce = bytes.fromhex(hello.nonce)
        assert hello.proof == P.server_proof(TOK_A, nonce, client_nonce)
        req = P.ExistsRequest(request_id=10, keys=["ab" * 32])
        req.token = P.request_proof(TOK_A, nonce, 10, req.TYPE)
        frames = P.encode(req)
        assert a.ask(req) == P.ExistsReply(request_id=10, count=0)
        replay = a.ask(req)  # the same request id again
        assert isinstance(replay, P.ErrorReply) and replay.code == P.ErrorCode.UNAUTHORIZED
        other.sock.send_multipart(frames)  # another connection: no hello there
        assert other.sock.poll(20000)
        moved = P.decode(other.sock.recv_multipart(), expect="reply")
        assert isinstance(moved, P.ErrorReply) and moved.code == P.ErrorCode.HELLO
        # A proof under another token's nonce, or of another type, does not pass.
        bad = P.GetRequest(request_id=11, keys=["ab" * 32])
        bad.token = P.request_proof(TOK_A, nonce, 11, "exists")
        wrong = a.ask(bad)
        assert isinstance(wrong, P.ErrorReply) and wrong.code == P.ErrorCode.UNAUTHORIZED
        unknown = a.call(P.HelloRequest(token_id=P.token_id("nobody-knows-this-1"),
                                        client_nonce=client_nonce.hex()))
        assert isinstance(unknown, P.ErrorReply) and unknown.code == P.ErrorCode.UNAUTHORIZED
    finally:
        a.close()
        other.close()


def test_a_server_that_does_not_hold_the_token_is_refused() -> None:
    """An impostor answers hello without knowing the token: the client refuses it."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def impostor() -> None:
        while sock.poll(10000):
            ident, *frames = sock.recv_multipart()
            req = P.decode(frames, expect="request")
            reply = P.HelloReply(request_id=req.request_id, nonce="00" * 32, proof="11" * 32)
            sock.send_multipart([ident, *P.encode(reply)])
            return

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    try:
        with pytest.raises(ConfigError, match="does not hold our auth token"):
            client_of(f"tcp://127.0.0.1:{port}", TOK_A, shm=False)
    finally:
        t.join(15)
        sock.close(0)
        ctx.term()


def test_a_restarted_server_gets_a_new_hello(tenants_server: HiCacheServerProc) -> None:
    keys, recs = pages("restart", N, 1000)
    b = client_of(tenants_server.url, TOK_B, encryption_key=KEY)
    try:
        assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * N
        tenants_server.restart()
        assert b.batch_exists(keys) == N
        out = buffers(N, len(recs[0]))
        assert b.batch_get(keys, out) == [True] * N
        assert [bytes(o) for o in out] == [bytes(r) for r in recs]
        assert b.stats().errors == 0
    finally:
        b.close()


def test_require_token_proof_refuses_plain_tokens(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from storage_backends.server.admin_cli import main as admin_main

    token = "shared-token-0000001"
    args = ["--require-token-proof", "--admin-token", ADMIN]
    with hicache_server(tmp_path, auth_token=token, args=args) as srv:
        # hicache-admin proves the admin token too; a wrong one is named.
        assert admin_main(["--url", srv.url, "--admin-token", ADMIN, "--json", "stats"]) == 0
        assert '"totals"' in capsys.readouterr().out
        assert admin_main(["--url", srv.url, "--admin-token", "wrong-admin-token-1", "stats"]) == 1
        assert "refused admin_stats: unauthorized: missing or wrong admin token" in \
            capsys.readouterr().err
        raw = RawClient(srv.url)
        try:
            reply = raw.call(P.PingRequest(token=token))
            assert isinstance(reply, P.ErrorReply) and reply.code == P.ErrorCode.UNAUTHORIZED
            assert "token proofs only" in reply.message
        finally:
            raw.close()
        b = srv.client()
        try:
            keys, recs = pages("req", N, 1000)
            assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * N
            assert b.batch_exists(keys) == N
        finally:
            b.close()
        with pytest.raises(ConfigError, match="token proofs only"):
            client_of(srv.url, token, token_proof="off")


def test_an_older_server_gets_the_token_unless_proofs_are_required(tmp_path: Path) -> None:
    token = "shared-token-0000002"
    srv = OldProtocolServer(tmp_path, versions=(1, 2, 3, 4, 5, 6), auth_token=token).start()
    try:
        b = client_of(srv.url, token)
        try:
            assert b.batch_exists(["ab" * 32]) == 0 and b.stats().errors == 0
        finally:
            b.close()
        with pytest.raises(ConfigError, match="predates token proofs"):
            client_of(srv.url, token, token_proof="required")
    finally:
        srv.stop()
    with pytest.raises(ConfigError, match="token_proof must be auto, required or off"):
        client_of(f"tcp://127.0.0.1:{free_port()}", token, token_proof="yes")


def test_a_server_without_auth_takes_a_client_with_a_token(tmp_path: Path) -> None:
    """As before proofs: the token is not needed there (logged); `required` refuses it."""
    with hicache_server(tmp_path) as srv:
        b = client_of(srv.url, "spare-token-00000001")
        try:
            keys, recs = pages("noauth", N, 1000)
            assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * N
            assert b.batch_exists(keys) == N and b.stats().errors == 0
        finally:
            b.close()
        with pytest.raises(ConfigError, match="does not hold our auth token"):
            client_of(srv.url, "spare-token-00000001", token_proof="required")
