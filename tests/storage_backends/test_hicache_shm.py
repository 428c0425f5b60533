"""The same-host shared-memory data path of `hicache-server` (protocol v2), against a real
server process: the region is used (no page byte crosses TCP), the TCP path is kept for
`"shm": false`, the client falls back to TCP when the server refuses or cannot open the region,
hostile descriptors and region files get error replies and never stop the server, a slot too
small for a value is never overflowed, and a restarted server gets a fresh region. Tests of the
read path run the server with its shared-memory store off (`REGION_ONLY`), so that reads go
through the region too (the store is tested in test_hicache_store.py)."""

from __future__ import annotations

import logging
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache_client.remote import connections as hicache_conn
from hicache_client.remote import protocol as P
from hicache_client.remote.shm import ClientRegion, plan
from tests.procs import free_port
from tests.storage_backends.hicache_server_proc import (
    OldProtocolServer,
    RawClient,
    hicache_server,
    pages,
    raw_clients,
)

PAYLOAD = (256 << 10) - 128  # 256 KiB records
REGION_ONLY = ["--shm-store-bytes", "0"]
SHM_COUNTERS = ("tcp_page_bytes_in", "tcp_page_bytes_out", "shm_page_bytes_in",
                "shm_page_bytes_out")


def _roundtrip(b: Any, keys: list[str], recs: list[bytearray]) -> None:
    assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * len(keys)
    out = [memoryview(bytearray(len(r))) for r in recs]
    assert b.batch_get(keys, out) == [True] * len(keys)
    assert [bytes(o) for o in out] == [bytes(r) for r in recs]


def _bytes(stats: dict[str, int]) -> dict[str, int]:
    return {k: stats[k] for k in SHM_COUNTERS}


def _tcp_only_roundtrip(b: Any, keys: list[str], recs: list[bytearray]) -> dict[str, int]:
    """Store and read back `recs`, check that every page byte went over TCP (none through
    shared memory), and return the server's stats."""
    _roundtrip(b, keys, recs)
    st = b.server_stats()
    total = sum(len(r) for r in recs)
    assert _bytes(st) == {"tcp_page_bytes_in": total, "tcp_page_bytes_out": total,
                          "shm_page_bytes_in": 0, "shm_page_bytes_out": 0}
    return st


@pytest.fixture
def raw_conns() -> Iterator[list[RawClient]]:
    with raw_clients() as made:
        yield made


def test_plan_rounds_fit_the_region() -> None:
    rounds = plan([4, 4, 4, 4, 4], batch_keys=2, batch_bytes=100, region=12)
    assert [[(list(c.idx), c.offsets) for c in r] for r in rounds] == [
        [([0, 1], [0, 4]), ([2], [8])],
        [([3, 4], [0, 4])],
    ]
    rounds = plan([5, 5, 5], batch_keys=10, batch_bytes=6, region=100)
    assert [[(list(c.idx), c.offsets) for c in r] for r in rounds] == [
        [([0], [0]), ([1], [5]), ([2], [10])]
    ]


def test_shm_client_moves_no_page_byte_over_tcp(tmp_path: Path) -> None:
    keys, recs = pages("shm", 40, PAYLOAD)  # 10 MiB: more than one 4 MiB request, pipelined
    total = sum(len(r) for r in recs)
    with hicache_server(tmp_path, args=REGION_ONLY) as srv:
        b = srv.client()
        _roundtrip(b, keys, recs)
        st = b.server_stats()
        assert _bytes(st) == {"tcp_page_bytes_in": 0, "tcp_page_bytes_out": 0,
                              "shm_page_bytes_in": total, "shm_page_bytes_out": total}
        assert (st["shm_attached"], st["shm_refused"], st["shm_regions"]) == (1, 0, 1)
        assert st["shm_mapped_bytes"] == 16 << 20  # 4 x batch_bytes
        assert b.stats().errors == 0
        # Nothing is left in /dev/shm: the client unlinked its region once attached.
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"hicache-{os.getpid()}-")]
        b.close()
        # The client detaches when it closes (best effort; the server answers it at once).
        probe = srv.client(shm=False)
        assert probe.server_stats()["shm_regions"] == 0
        probe.close()


def test_tcp_client_moves_no_page_byte_over_shm(tmp_path: Path) -> None:
    keys, recs = pages("tcp", 8, PAYLOAD)
    with hicache_server(tmp_path) as srv:
        b = srv.client(shm=False)
        st = _tcp_only_roundtrip(b, keys, recs)
        assert (st["shm_attached"], st["shm_regions"]) == (0, 0)
        b.close()


def test_batch_larger_than_the_region_goes_in_rounds(tmp_path: Path) -> None:
    keys, recs = pages("rounds", 12, PAYLOAD)  # 3 MiB through a 1 MiB region: 3 rounds each way
    total = sum(len(r) for r in recs)
    with hicache_server(tmp_path, args=REGION_ONLY) as srv:
        b = srv.client(shm_bytes=1 << 20, batch_bytes=512 << 10)
        _roundtrip(b, keys, recs)
        assert _bytes(b.server_stats()) == {"tcp_page_bytes_in": 0, "tcp_page_bytes_out": 0,
                                            "shm_page_bytes_in": total,
                                            "shm_page_bytes_out": total}
        b.close()


def test_record_larger_than_the_region_goes_over_tcp(tmp_path: Path) -> None:
    keys, recs = pages("big", 3, PAYLOAD)
    with hicache_server(tmp_path, args=REGION_ONLY) as srv:
        b = srv.client(shm_bytes=64 << 10)  # smaller than one record
        _tcp_only_roundtrip(b, keys, recs)
        b.close()


def test_server_with_no_shm_refuses_and_the_client_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys, recs = pages("noshm", 4, PAYLOAD)
    with hicache_server(tmp_path, args=["--no-shm"]) as srv:
        with caplog.at_level(logging.INFO, logger="hicache_client.remote.connections"):
            b = srv.client()
        assert b.shm_enabled is False
        assert sum("shared memory off" in r.message for r in caplog.records) == 1
        st = _tcp_only_roundtrip(b, keys, recs)
        assert (st["shm_refused"], st["shm_attached"], st["shm_regions"]) == (1, 0, 0)
        assert b.stats().errors == 0
        b.close()
    assert "shared memory off" in srv.log()


class _VanishingRegion(ClientRegion):
    """A region whose file is gone before the server opens it (the server is elsewhere)."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.unlink()


class _WorldReadableRegion(ClientRegion):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        os.chmod(self.path, 0o644)


@pytest.mark.parametrize("region_cls", [_VanishingRegion, _WorldReadableRegion])
def test_region_the_server_cannot_open_falls_back_to_tcp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, region_cls: type[ClientRegion]
) -> None:
    monkeypatch.setattr(hicache_conn, "ClientRegion", region_cls)
    keys, recs = pages("fallback", 4, PAYLOAD)
    with hicache_server(tmp_path) as srv:
        b = srv.client()
        assert b.shm_enabled is False
        st = _tcp_only_roundtrip(b, keys, recs)
        assert (st["shm_refused"], st["shm_regions"]) == (1, 0)
        b.close()


def _attached(
    url: str, conns: list[RawClient], size: int = 1 << 20
) -> tuple[RawClient, ClientRegion]:
    r = RawClient(url)
    conns.append(r)
    region = ClientRegion(size)
    reply = r.ask(P.AttachShmRequest(request_id=1, name=region.name, size=size))
    assert isinstance(reply, P.AttachShmReply)
    return r, region


def test_hostile_descriptors_get_error_replies(tmp_path: Path, raw_conns: list[RawClient]) -> None:
    size = 1 << 20
    with hicache_server(tmp_path) as srv:
        r, region = _attached(srv.url, raw_conns, size)
        region.buf[:4] = b"good"
        bad = [(-1, 4), (0, -1), (size, 1), (0, size + 1), (size - 2, 4), (2**63, 1),
               (1, 2**64 - 1), (2**64 - 1, 2**64 - 1)]
        for rid, (off, n) in enumerate(bad, start=10):
            reply = r.ask(P.ShmSetRequest(request_id=rid, keys=["k"], offsets=[off],
                                          lengths=[n]))
            assert isinstance(reply, P.ErrorReply), (off, n)
            assert (reply.code, reply.request_id) == (P.ErrorCode.MALFORMED, rid)
            assert "outside" in reply.message
            # A bad slot in a get: the whole request is refused before any byte is written.
            reply = r.ask(P.ShmGetRequest(request_id=rid, keys=["k", "k"], offsets=[0, off],
                                          capacities=[4, n]))
            assert isinstance(reply, P.ErrorReply) and reply.code == P.ErrorCode.MALFORMED
        # Mismatched lists are malformed too.
        reply = r.ask(P.ShmSetRequest(request_id=3, keys=["k"], offsets=[0, 1], lengths=[1]))
        assert isinstance(reply, P.ErrorReply) and reply.code == P.ErrorCode.MALFORMED
        # Nothing was stored; the server still serves, and a good descriptor works.
        reply = r.ask(P.ShmSetRequest(request_id=4, keys=["k"], offsets=[0], lengths=[4]))
        assert isinstance(reply, P.SetReply) and reply.stored == [True]
        st = r.ask(P.StatsRequest(request_id=5))
        assert isinstance(st, P.StatsReply)
        assert (st.stats["pages"], st.stats["bytes"], st.stats["shm_page_bytes_in"]) == (1, 4, 4)
        region.buf[100:104] = b"\0\0\0\0"
        reply = r.ask(P.ShmGetRequest(request_id=6, keys=["k"], offsets=[100], capacities=[4]))
        assert isinstance(reply, P.ShmGetReply) and reply.lengths == [4]
        assert bytes(region.buf[100:104]) == b"good"
        region.close()


def test_slot_too_small_is_never_overflowed(tmp_path: Path, raw_conns: list[RawClient]) -> None:
    with hicache_server(tmp_path) as srv:
        r, region = _attached(srv.url, raw_conns)
        region.buf[0:1000] = b"v" * 1000
        reply = r.ask(P.ShmSetRequest(request_id=1, keys=["big"], offsets=[0], lengths=[1000]))
        assert isinstance(reply, P.SetReply) and reply.stored == [True]
        region.buf[2000:3000] = b"\xee" * 1000
        reply = r.ask(P.ShmGetRequest(request_id=2, keys=["big", "absent"], offsets=[2000, 2500],
                                      capacities=[999, 500]))
        assert isinstance(reply, P.ShmGetReply)
        assert reply.lengths == [1000, -1]  # the true length; not written: it does not fit
        assert bytes(region.buf[2000:3000]) == b"\xee" * 1000
        region.close()
    # The backend: a buffer smaller than the stored record is a miss (never a partial copy).
    keys, recs = pages("small", 1, PAYLOAD)
    with hicache_server(tmp_path / "2") as srv:
        b = srv.client()
        assert b.batch_set(keys, [memoryview(recs[0])]) == [True]
        out = memoryview(bytearray(b"\x5a" * (len(recs[0]) // 2)))
        assert b.batch_get(keys, [out]) == [False]
        assert bytes(out) == b"\x5a" * len(out)
        b.close()


def test_bad_region_files_are_refused(tmp_path: Path, raw_conns: list[RawClient]) -> None:
    link = f"hicache-test-link-{os.getpid()}"
    target = ClientRegion(4096)
    os.symlink(target.path, f"/dev/shm/{link}")
    try:
        with hicache_server(tmp_path) as srv:
            r = RawClient(srv.url)
            raw_conns.append(r)
            # A missing file, a symlink and a wrong size get the same words: the reply says
            # nothing of what /dev/shm holds (issue 46).
            cases = [
                (link, 4096, "cannot be attached"),  # a symlink (O_NOFOLLOW)
                ("../etc/passwd", 4096, "not a plain file name"),
                ("a/b", 4096, "not a plain file name"),
                (".hidden", 4096, "not a plain file name"),
                (f"hicache-absent-{os.getpid()}", 4096, "cannot be attached"),
                (target.name, 8192, "cannot be attached"),  # wrong size
                (target.name, 0, "must be > 0"),
                (target.name, 4 << 30, "--shm-max-bytes"),
            ]
            for name, size, why in cases:
                reply = r.ask(P.AttachShmRequest(request_id=2, name=name, size=size))
                assert isinstance(reply, P.ErrorReply), name
                assert reply.code == P.ErrorCode.NO_SHM and why in reply.message, reply.message
            # Not attached: shm requests are refused, TCP requests still work.
            reply = r.ask(P.ShmGetRequest(request_id=3, keys=["k"], offsets=[0], capacities=[1]))
            assert isinstance(reply, P.ErrorReply) and reply.code == P.ErrorCode.NO_SHM
            st = r.ask(P.StatsRequest(request_id=4))
            assert isinstance(st, P.StatsReply)
            assert (st.stats["shm_refused"], st.stats["shm_regions"]) == (len(cases), 0)
    finally:
        os.unlink(f"/dev/shm/{link}")
        target.close()


def test_shrunk_region_is_detached_not_a_crash(tmp_path: Path, raw_conns: list[RawClient]) -> None:
    with hicache_server(tmp_path) as srv:
        r, region = _attached(srv.url, raw_conns)
        os.truncate(region.path, 0)  # would make the server's next access SIGBUS
        reply = r.ask(P.ShmGetRequest(request_id=2, keys=["k"], offsets=[0], capacities=[8]))
        assert isinstance(reply, P.ErrorReply) and reply.code == P.ErrorCode.NO_SHM
        assert "shrunk" in reply.message
        assert isinstance(r.ask(P.PingRequest(request_id=3)), P.PingReply)
        assert srv.alive()
        region.close()


def test_restarted_server_gets_a_fresh_region(tmp_path: Path) -> None:
    keys, recs = pages("restart", 4, PAYLOAD)
    with hicache_server(tmp_path, persist_dir=tmp_path / "pages", args=REGION_ONLY) as srv:
        b = srv.client()
        _roundtrip(b, keys, recs)
        srv.restart()  # the new server has no region for the pooled connection
        out = [memoryview(bytearray(len(r))) for r in recs]
        # The first call meets `no_shm`, attaches again and is served (persisted pages).
        assert b.batch_get(keys, out) == [True] * 4
        assert [bytes(o) for o in out] == [bytes(r) for r in recs]
        st = b.server_stats()
        assert (st["shm_attached"], st["tcp_page_bytes_out"]) == (1, 0)
        assert st["shm_page_bytes_out"] == sum(len(r) for r in recs)
        assert b.stats().errors == 0
        b.close()


def test_page_bytes_metric_by_path(tmp_path: Path) -> None:
    mport = free_port()
    keys, recs = pages("metric", 2, PAYLOAD)
    total = sum(len(r) for r in recs)
    with hicache_server(tmp_path, metrics_port=mport, args=REGION_ONLY) as srv:
        b = srv.client()
        _roundtrip(b, keys, recs)
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read()
        metrics = {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in text.decode().splitlines()
            if line and not line.startswith("#")
        }
        assert metrics['hicache_server_page_bytes_total{dir="in",path="shm"}'] == total
        assert metrics['hicache_server_page_bytes_total{dir="out",path="shm"}'] == total
        b.close()


def test_tcp_and_shm_clients_share_pages(tmp_path: Path) -> None:
    """Pages stored from frames (kept as received zmq frames) are served into regions, and
    pages stored from a region are served as frames, bit for bit."""
    keys_t, recs_t = pages("from-tcp", 4, PAYLOAD)
    keys_s, recs_s = pages("from-shm", 4, PAYLOAD)
    with hicache_server(tmp_path, args=REGION_ONLY) as srv:
        tcp, shm = srv.client(shm=False), srv.client()
        assert tcp.batch_set(keys_t, [memoryview(r) for r in recs_t]) == [True] * 4
        assert shm.batch_set(keys_s, [memoryview(r) for r in recs_s]) == [True] * 4
        for reader, keys, recs in ((shm, keys_t, recs_t), (tcp, keys_s, recs_s)):
            out = [memoryview(bytearray(len(r))) for r in recs]
            assert reader.batch_get(keys, out) == [True] * 4
            assert [bytes(o) for o in out] == [bytes(r) for r in recs]
        total = sum(len(r) for r in recs_t)
        assert _bytes(shm.server_stats()) == {"tcp_page_bytes_in": total,
                                              "tcp_page_bytes_out": total,
                                              "shm_page_bytes_in": total,
                                              "shm_page_bytes_out": total}
        tcp.close()
        shm.close()


def test_new_client_on_a_version_1_server_uses_tcp(tmp_path: Path) -> None:
    keys, recs = pages("v1", 4, PAYLOAD)
    srv = OldProtocolServer(tmp_path, (1,)).start()
    try:
        b = srv.client()
        assert b.shm_enabled is False
        st = _tcp_only_roundtrip(b, keys, recs)
        assert (st["shm_attached"], st["shm_regions"]) == (0, 0)
        assert b.stats().errors == 0
        b.close()
    finally:
        srv.stop()
