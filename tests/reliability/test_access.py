"""Access: `hicache-server --auth-token` refuses every message type without the right token and
never writes the token to its log; servers bind loopback unless told otherwise."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import zmq

from hicache_client.errors import ConfigError
from hicache_client.remote import protocol as P
from tests.procs import ManagedProcess, free_port, wait_for_port
from tests.storage_backends.hicache_server_proc import (
    REPO_ROOT,
    HiCacheServerProc,
    codec,
    page_key,
    page_record,
)

TOKEN = "tok-9f8e7d6c5b4a-secret"


def every_request() -> list[P.Request]:
    rec = bytes(page_record(codec(), "auth", 1))
    return [
        P.PingRequest(),
        P.ExistsRequest(keys=[page_key("auth", 0)]),
        P.GetRequest(keys=[page_key("auth", 0)]),
        P.SetRequest(keys=[page_key("auth", 1)], frames=[rec]),
        P.DeleteRequest(keys=[page_key("auth", 0)]),
        P.ClearRequest(),
        P.StatsRequest(),
    ]


def listening(port: int) -> list[tuple[str, str]]:
    """(family, local address) of every TCP socket listening on `port` in this namespace."""
    out = []
    for fam, path in (("v4", "/proc/net/tcp"), ("v6", "/proc/net/tcp6")):
        try:
            lines = Path(path).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            addr, port_hex = cols[1].rsplit(":", 1)
            if int(port_hex, 16) == port and cols[3] == "0A":  # TCP_LISTEN
                out.append((fam, addr))
    return out


@pytest.mark.parametrize("how", ["env", "flag"])
def test_auth_token_refuses_every_type_and_stays_out_of_logs(tmp_path: Path, how: str) -> None:
    if how == "env":
        srv = HiCacheServerProc(tmp_path, auth_token=TOKEN, args=["--log-level", "DEBUG"])
    else:
        srv = HiCacheServerProc(tmp_path, args=["--auth-token", TOKEN, "--log-level", "DEBUG"])
    srv.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.url)
    try:
        good = srv.client(auth_token=TOKEN)
        rec = page_record(codec(), "auth", 0)
        assert good.batch_set([page_key("auth", 0)], [memoryview(rec)]) == [True]
        refused = 0
        for n, req in enumerate(every_request()):
            for token in ["", "wrong", TOKEN[:-1], TOKEN + "x", TOKEN.upper(), " " + TOKEN]:
                req.request_id = 100 + n
                req.token = token
                sock.send_multipart(P.encode(req))
                assert sock.poll(10000), "no answer"
                reply = P.decode(sock.recv_multipart(), expect="reply")
                assert isinstance(reply, P.ErrorReply), (req.TYPE, token)
                assert (reply.code, reply.request_id) == (P.ErrorCode.UNAUTHORIZED, 100 + n)
                assert TOKEN not in reply.message
                refused += 1
        # A token of the wrong type is refused too (as malformed), never accepted.
        for bad in ([b"\x82\xa1v\x01\xa1t\xa4ping"], ):
            sock.send_multipart(bad)
            assert sock.poll(10000)
            assert isinstance(P.decode(sock.recv_multipart(), expect="reply"), P.ErrorReply)
        # Nothing the refused requests asked for happened (not the clear, not the delete).
        assert good.batch_exists([page_key("auth", 0)]) == 1
        assert good.batch_exists([page_key("auth", 1)]) == 0
        for token in ["", "wrong"]:
            with pytest.raises(ConfigError):
                srv.client(auth_token=token)
        stats = good.server_stats()
        assert stats["unauthorized"] >= refused
        good.close()
    finally:
        sock.close(0)
        ctx.term()
        srv.stop()
    log = srv.log()
    assert "auth required" in log or "auth" in log  # the log was written
    assert TOKEN not in log
    assert TOKEN[:-1] not in log


def test_hicache_server_binds_loopback_by_default(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "storage_backends.server", "--port", str(port),
            "--capacity", "16MiB"]
    with ManagedProcess(argv, tmp_path / "server.log", cwd=REPO_ROOT) as proc:
        wait_for_port(port, proc=proc.proc, timeout=60)
        assert listening(port) == [("v4", "0100007F")]  # 127.0.0.1, nothing else
