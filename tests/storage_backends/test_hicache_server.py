"""`hicache-server` as a real process on a free loopback port, and the `hicache` backend against
it: sharing across processes, persistence and crashes, concurrency, hostile frames, eviction
order, a dead server, metrics."""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from hicache_client.codec import HEADER_BYTES
from hicache_client.errors import ConfigError, StorageUnavailable
from hicache_client.remote import protocol as P
from storage_backends.server.server import build_parser, parse_size
from tests.procs import free_port, wait_until
from tests.storage_backends.hicache_server_proc import (
    REPO_ROOT,
    HiCacheServerProc,
    codec,
    hicache_server,
    mixed_worker,
    page_key,
    page_record,
    read_pages,
    write_pages,
)

SPAWN = mp.get_context("spawn")
RECORD = 4096  # bytes of one test record (3968-byte payload + 128-byte header)


def _run_in_process(target: Callable[..., Any], *args: Any) -> None:
    p = SPAWN.Process(target=target, args=args)
    p.start()
    p.join(timeout=300)
    assert p.exitcode == 0, f"{target.__name__} exited with {p.exitcode}"


class RawClient:
    """A bare DEALER socket, for sending frames no well-behaved client would."""

    def __init__(self, url: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(url)

    def ask(self, frames: list[Any]) -> P.Message:
        self.sock.send_multipart(frames)
        return self.answer()

    def answer(self) -> P.Message:
        assert self.sock.poll(10000), "server did not answer"
        frames = self.sock.recv_multipart()
        if len(frames) > 1 and frames[0] == b"":  # echoed REQ-style delimiter
            frames = frames[1:]
        return P.decode(frames, expect="reply")

    def request(self, msg: P.Request) -> P.Message:
        return self.ask(P.encode(msg))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def raw() -> Iterator[Callable[[str], RawClient]]:
    made: list[RawClient] = []

    def make(url: str) -> RawClient:
        made.append(RawClient(url))
        return made[-1]

    yield make
    for c in made:
        c.close()


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,value",
    [
        ("4096", 4096),
        ("512MiB", 512 << 20),
        ("8GiB", 8 << 30),
        ("1TiB", 1 << 40),
        ("8GB", 8 * 10**9),
        ("8G", 8 << 30),
        ("64KiB", 65536),
        ("1.5GiB", 3 << 29),
        ("0", 0),
    ],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "-1", "8XB", "1.3", "8 i"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_help_documents_every_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "storage_backends.server", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=True,
    ).stdout
    actions = [a for a in build_parser()._actions if a.option_strings]
    for a in actions:
        assert a.help, f"{a.option_strings} has no help"
        assert a.option_strings[-1] in out
    for flag in [
        "--host",
        "--port",
        "--capacity",
        "--persist-dir",
        "--persist-queue",
        "--auth-token",
        "--max-frame-bytes",
        "--metrics-port",
        "--no-shm",
        "--shm-max-bytes",
        "--log-level",
    ]:
        assert flag in out


# --------------------------------------------------------------------------------------------
# Eviction
# --------------------------------------------------------------------------------------------


def test_capacity_eviction_is_exact_lru(tmp_path: Path) -> None:
    with hicache_server(tmp_path, capacity=str(4 * RECORD)) as srv:
        b = srv.client()
        c = codec()
        assert c.record_bytes == RECORD
        keys = [page_key("lru", i) for i in range(7)]
        recs = [memoryview(page_record(c, "lru", i)) for i in range(7)]

        def present() -> list[int]:
            return [i for i in range(7) if b.batch_exists([keys[i]]) == 1]

        for i in range(4):
            assert b.batch_set([keys[i]], [recs[i]]) == [True]
        # LRU order: 0 1 2 3. A get makes a page most recent: 1 2 3 0.
        assert b.batch_get([keys[0]], [memoryview(bytearray(RECORD))]) == [True]
        assert b.batch_set([keys[4]], [recs[4]]) == [True]  # evicts 1 -> 2 3 0 4
        assert present() == [0, 2, 3, 4]
        # exists is not a use: 2 stays least recent.
        assert b.batch_exists([keys[2]]) == 1
        assert b.batch_set([keys[5]], [recs[5]]) == [True]  # evicts 2 -> 3 0 4 5
        assert b.batch_get([keys[3]], [memoryview(bytearray(RECORD))]) == [True]  # 0 4 5 3
        assert b.batch_set([keys[6]], [recs[6]]) == [True]  # evicts 0 -> 4 5 3 6
        assert present() == [3, 4, 5, 6]
        # Re-setting a present key refreshes it and evicts nothing.
        assert b.batch_set([keys[4]], [recs[4]]) == [True]  # 5 3 6 4
        assert b.batch_set([keys[0]], [recs[0]]) == [True]  # evicts 5 -> 3 6 4 0
        assert present() == [0, 3, 4, 6]
        # A page larger than the whole capacity is refused, nothing is evicted for it.
        assert b.batch_set(["huge"], [memoryview(bytearray(4 * RECORD + 1))]) == [False]
        s = b.server_stats()
        assert (s["pages"], s["bytes"], s["evictions"], s["rejected"]) == (4, 4 * RECORD, 4, 1)
        assert b.stats().set_failures == 1
        b.close()


# --------------------------------------------------------------------------------------------
# Sharing between processes
# --------------------------------------------------------------------------------------------


def test_two_client_processes_share_10000_pages(tmp_path: Path) -> None:
    with hicache_server(tmp_path, capacity="1GiB", auth_token="tok") as srv:
        _run_in_process(write_pages, srv.url, "tok", "shared10k", 10_000)
        _run_in_process(read_pages, srv.url, "tok", "shared10k", 10_000)
        b = srv.client()
        s = b.server_stats()
        assert (s["pages"], s["bytes"], s["evictions"]) == (10_000, 10_000 * RECORD, 0)
        assert s["hits"] == 10_000
        b.close()


def test_batches_are_split_and_pipelined(tmp_path: Path) -> None:
    with hicache_server(tmp_path) as srv:
        b = srv.client(batch_keys=7, batch_bytes=3 * RECORD)
        c = codec()
        n = 50
        keys = [page_key("split", i) for i in range(n)]
        recs = [page_record(c, "split", i) for i in range(n)]
        assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * n
        assert b.batch_exists(keys) == n
        assert b.batch_exists(keys[:20] + ["absent"] + keys[20:]) == 20
        out = [memoryview(bytearray(RECORD)) for _ in range(n + 1)]
        assert (
            b.batch_get([*keys[:30], "absent", *keys[30:]], out)
            == [True] * 30 + [False] + [True] * 20
        )
        assert [bytes(o) for o in out[:30] + out[31:]] == [bytes(r) for r in recs]
        s = b.stats()
        assert (s.set_pages, s.set_failures, s.get_pages, s.get_hits) == (n, 0, n + 1, n)
        assert (s.errors, s.bytes_written, s.bytes_read) == (0, n * RECORD, n * RECORD)
        b.close()


# --------------------------------------------------------------------------------------------
# Persistence
# --------------------------------------------------------------------------------------------


def test_restart_after_clean_shutdown_serves_every_page(tmp_path: Path) -> None:
    persist = tmp_path / "persist"
    srv = HiCacheServerProc(tmp_path, persist_dir=persist, args=["--persist-queue", "100000"])
    srv.start()
    try:
        _run_in_process(write_pages, srv.url, None, "persist", 3000)
        b = srv.client()
        assert b.server_stats()["persist_dropped"] == 0
        b.close()
        assert srv.stop() == 0
        log = srv.log()
        assert "persistence flushed (3000 pages written)" in log
        srv.start()
        assert "persistence at" in srv.log() and "loaded 3000 pages" in srv.log()
        read_pages(srv.url, None, "persist", 3000)
        b = srv.client()
        s = b.server_stats()
        # Read back lazily from disk into memory on first use.
        assert (s["pages"], s["persist_loaded"], s["persist_written"]) == (3000, 3000, 0)
        # Deleted pages stay deleted across a restart, the others stay.
        b.delete([page_key("persist", i) for i in range(10)])
        b.close()
        assert srv.stop() == 0
        srv.start()
        b = srv.client()
        c = codec()
        keys = [page_key("persist", i) for i in range(20)]
        out = [memoryview(bytearray(RECORD)) for _ in keys]
        assert b.batch_get(keys, out) == [False] * 10 + [True] * 10
        assert all(bytes(out[i]) == bytes(page_record(c, "persist", i)) for i in range(10, 20))
        b.close()
    finally:
        srv.stop()


def test_pages_evicted_from_memory_are_read_back_from_disk(tmp_path: Path) -> None:
    with hicache_server(
        tmp_path, capacity=str(4 * RECORD), persist_dir=tmp_path / "persist"
    ) as srv:
        b = srv.client()
        c = codec()
        keys = [page_key("spill", i) for i in range(20)]
        recs = [page_record(c, "spill", i) for i in range(20)]
        assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * 20
        wait_until(lambda: b.server_stats()["persist_pending"] == 0)
        s = b.server_stats()
        assert (s["pages"], s["evictions"], s["persist_written"]) == (4, 16, 20)
        # Presence and reads fall through to disk; what is read comes back into memory.
        assert b.batch_exists(keys) == 20
        out = [memoryview(bytearray(RECORD)) for _ in keys]
        assert b.batch_get(keys, out) == [True] * 20
        assert [bytes(o) for o in out] == [bytes(r) for r in recs]
        assert b.server_stats()["pages"] == 4
        b.close()


def test_full_write_behind_queue_drops_persistence_not_pages(tmp_path: Path) -> None:
    persist = tmp_path / "persist"
    args = ["--persist-queue", "1", "--persist-block-ms", "0"]
    n = 600
    with hicache_server(tmp_path, persist_dir=persist, args=args) as srv:
        _run_in_process(write_pages, srv.url, None, "drop", n)
        # Every page is served from memory whatever happened to its persistence.
        read_pages(srv.url, None, "drop", n)
        b = srv.client()
        dropped = b.server_stats()["persist_dropped"]
        b.close()
    # A queue of one page cannot keep up with 128-page requests that may not wait.
    assert dropped > 0
    # After the flush every page was either written or dropped (counted), never both.
    log = srv.log()
    srv.start()
    b = srv.client()
    s0 = b.server_stats()
    keys = [page_key("drop", i) for i in range(n)]
    out = [memoryview(bytearray(RECORD)) for _ in keys]
    ok = b.batch_get(keys, out)
    c = codec()
    for i in range(n):
        if ok[i]:
            assert bytes(out[i]) == bytes(page_record(c, "drop", i))
    assert s0["persist_loaded"] == sum(ok)
    written = int(log.split("persistence flushed (")[1].split(" ")[0])
    assert written == sum(ok)
    assert written + dropped == n
    assert b.stats().corrupt_pages == 0
    b.close()
    srv.stop()


def test_kill_9_during_a_write_burst_serves_nothing_corrupt(tmp_path: Path) -> None:
    persist = tmp_path / "persist"
    srv = HiCacheServerProc(tmp_path, persist_dir=persist, args=["--persist-queue", "512"])
    srv.start()
    c = codec()
    n_max = 20_000
    attempted = [0]
    stop = threading.Event()

    def burst() -> None:
        b = srv.client(timeout_ms=1000)
        try:
            for start in range(0, n_max, 64):
                if stop.is_set():
                    return
                idx = range(start, start + 64)
                attempted[0] = start + 64
                ok = b.batch_set(
                    [page_key("burst", i) for i in idx],
                    [memoryview(page_record(c, "burst", i)) for i in idx],
                )
                if not all(ok):
                    return  # the server is gone
        finally:
            b.close()

    t = threading.Thread(target=burst)
    t.start()
    try:
        probe = srv.client()
        wait_until(lambda: probe.server_stats().get("persist_written", 0) >= 1000)
        probe.close()
        srv.kill()
        stop.set()
        t.join(timeout=60)
        assert not t.is_alive()
        srv.start()
        b = srv.client()
        n = attempted[0]
        hits = 0
        for start in range(0, n, 256):
            idx = range(start, min(n, start + 256))
            out = [memoryview(bytearray(RECORD)) for _ in idx]
            ok = b.batch_get([page_key("burst", i) for i in idx], out)
            for i, good, buf in zip(idx, ok, out):
                if good:
                    hits += 1
                    assert bytes(buf) == bytes(page_record(c, "burst", i)), f"page {i} differs"
        s = b.stats()
        assert s.corrupt_pages == 0
        assert s.errors == 0
        assert 1000 <= hits <= n
        b.close()
    finally:
        stop.set()
        t.join(timeout=60)
        srv.stop()


# --------------------------------------------------------------------------------------------
# Concurrency
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_eight_client_processes_mixed_operations(tmp_path: Path) -> None:
    seconds = 30.0
    with hicache_server(tmp_path, capacity="2GiB") as srv:
        procs = []
        for w in range(8):
            p = SPAWN.Process(
                target=mixed_worker, args=(srv.url, w, seconds, str(tmp_path / f"w{w}.json"))
            )
            p.start()
            procs.append(p)
        for p in procs:
            p.join(timeout=seconds + 120)
            assert p.exitcode == 0
        b = srv.client()
        c = codec()
        total_ops = 0
        for w in range(8):
            r = json.loads((tmp_path / f"w{w}.json").read_text())
            assert (r["mismatches"], r["errors"], r["corrupt"], r["set_failures"]) == (0, 0, 0, 0)
            total_ops += r["ops"]
            keys = [page_key(f"w{w}", i) for i in r["stored"]]
            out = [memoryview(bytearray(RECORD)) for _ in keys]
            assert b.batch_get(keys, out) == [True] * len(keys)
            for i, buf in zip(r["stored"], out):
                assert bytes(buf) == bytes(page_record(c, f"w{w}", i))
        s = b.server_stats()
        assert s["evictions"] == 0
        assert s["error_replies"] == 0
        assert total_ops > 8
        b.close()
        assert srv.alive()


# --------------------------------------------------------------------------------------------
# Hostile clients
# --------------------------------------------------------------------------------------------

ALL_REQUESTS: list[P.Request] = [
    P.PingRequest(),
    P.ExistsRequest(keys=["a"]),
    P.GetRequest(keys=["a"]),
    P.SetRequest(keys=["a"], frames=[b"x" * 10]),
    P.DeleteRequest(keys=["a"]),
    P.ClearRequest(),
    P.StatsRequest(),
    P.AttachShmRequest(name="hicache-none", size=4096),
    P.DetachShmRequest(),
    P.ShmSetRequest(keys=["a"], offsets=[0], lengths=[1]),
    P.ShmGetRequest(keys=["a"], offsets=[0], capacities=[1]),
]


def test_wrong_or_missing_token_is_refused_for_every_type(
    tmp_path: Path, raw: Callable[[str], RawClient]
) -> None:
    with hicache_server(tmp_path, auth_token="s3cret-token") as srv:
        good = srv.client()
        c = codec()
        assert good.batch_set([page_key("t", 0)], [memoryview(page_record(c, "t", 0))]) == [True]
        r = raw(srv.url)
        for n, req in enumerate(ALL_REQUESTS):
            for token in ["wrong", "", "s3cret-token2", "s3cret-toke"]:
                req.request_id = 1000 + n
                req.token = token
                reply = r.request(req)
                assert isinstance(reply, P.ErrorReply), (req.TYPE, token)
                assert reply.code == P.ErrorCode.UNAUTHORIZED
                assert reply.request_id == 1000 + n
        # Nothing was changed by the refused requests (clear and delete included).
        assert good.batch_exists([page_key("t", 0)]) == 1
        with pytest.raises(ConfigError):
            srv.client(auth_token="wrong")
        with pytest.raises(ConfigError):
            srv.client(auth_token="")
        assert good.server_stats()["unauthorized"] == 4 * len(ALL_REQUESTS) + 2
        good.close()
        assert srv.alive()
    assert "s3cret-token" not in srv.log()


def test_garbage_truncated_and_type_confused_frames(
    tmp_path: Path, raw: Callable[[str], RawClient]
) -> None:
    def h(**fields: Any) -> bytes:
        return msgpack.packb(fields, use_bin_type=True)

    get = {"v": 1, "t": "get", "id": 7, "auth": "", "keys": ["a"]}
    cases: list[tuple[list[bytes], str]] = [
        ([b"\xc1\xc1\xc1 not msgpack"], P.ErrorCode.MALFORMED),
        ([h(**get)[:-2]], P.ErrorCode.MALFORMED),
        ([msgpack.packb([1, "get", 7, ["a"]])], P.ErrorCode.MALFORMED),
        ([h(**{**get, "keys": "a"})], P.ErrorCode.MALFORMED),
        ([h(**{**get, "keys": [1, 2]})], P.ErrorCode.MALFORMED),
        ([h(**{**get, "id": "7"})], P.ErrorCode.MALFORMED),
        ([h(**{**get, "v": 99})], P.ErrorCode.BAD_VERSION),
        ([h(**{**get, "t": "get_ok"})], P.ErrorCode.UNKNOWN_TYPE),
        ([h(**{**get, "t": "drop_tables"})], P.ErrorCode.UNKNOWN_TYPE),
        ([h(v=1, t="set", id=7, auth="", keys=["a", "b"]), b"one frame"], P.ErrorCode.MALFORMED),
        ([h(v=1, t="set", id=7, auth="", keys=[]), b"stray"], P.ErrorCode.MALFORMED),
        ([h(**get), b"stray"], P.ErrorCode.MALFORMED),
        ([b""], P.ErrorCode.MALFORMED),
        ([b"", b""], P.ErrorCode.MALFORMED),
    ]
    with hicache_server(tmp_path) as srv:
        r = raw(srv.url)
        for frames, code in cases:
            reply = r.ask(frames)
            assert isinstance(reply, P.ErrorReply), frames
            assert reply.code == code, (frames, reply)
            assert reply.message
        # Random junk in a burst, then the server still works for everyone.
        for i in range(200):
            r.sock.send_multipart([bytes([i % 256]) * (i % 37), b"\x00" * (i % 3)])
        for _ in range(200):
            assert isinstance(r.answer(), P.ErrorReply)
        pong = r.request(P.PingRequest(request_id=42))
        assert isinstance(pong, P.PingReply) and pong.request_id == 42
        # A REQ socket (empty delimiter frame) is served too.
        req = r.ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(srv.url)
        req.send_multipart(P.encode(P.PingRequest(request_id=43)))
        assert req.poll(10000)
        assert P.decode(req.recv_multipart()).request_id == 43
        req.close(0)
        b = srv.client()
        assert b.batch_set([page_key("g", 0)], [memoryview(page_record(codec(), "g", 0))]) == [True]
        assert b.server_stats()["error_replies"] == len(cases) + 200
        b.close()
        assert srv.alive()


def test_oversized_frames_are_refused(tmp_path: Path, raw: Callable[[str], RawClient]) -> None:
    limit = 64 * 1024
    with hicache_server(tmp_path, args=["--max-frame-bytes", "64KiB"]) as srv:
        r = raw(srv.url)
        big = P.encode(P.SetRequest(request_id=5, keys=["a"], frames=[b"x" * (limit + 1)]))
        reply = r.ask(big)
        assert isinstance(reply, P.ErrorReply)
        assert (reply.code, reply.request_id) == (P.ErrorCode.TOO_LARGE, 5)
        assert "65537" in reply.message and "65536" in reply.message
        huge_header = P.encode(P.ExistsRequest(request_id=6, keys=["k" * 1000] * 100))
        reply = r.ask(huge_header)
        assert isinstance(reply, P.ErrorReply) and reply.code == P.ErrorCode.TOO_LARGE
        ok = P.encode(P.SetRequest(request_id=7, keys=["a"], frames=[b"x" * limit]))
        assert isinstance(r.ask(ok), P.SetReply)
        # The client learns the limit and does not send what would be refused.
        b = srv.client()
        assert b.max_frame_bytes == limit
        c = codec(limit - HEADER_BYTES)
        small = codec()
        recs = [page_record(c, "big", 0), page_record(small, "big", 1)]
        assert b.batch_set(
            [page_key("big", 0), page_key("big", 1)], [memoryview(x) for x in recs]
        ) == [True, True]
        too_big = bytearray(limit + 1)
        assert b.batch_set(["x"], [memoryview(too_big)]) == [False]
        assert b.stats().errors == 0
        b.close()
        assert srv.alive()


# --------------------------------------------------------------------------------------------
# A dead server
# --------------------------------------------------------------------------------------------


def test_dead_server_means_misses_then_recovery(tmp_path: Path) -> None:
    srv = HiCacheServerProc(tmp_path)
    srv.start()
    c = codec()
    keys = [page_key("dead", i) for i in range(8)]
    recs = [memoryview(page_record(c, "dead", i)) for i in range(8)]
    b = srv.client(timeout_ms=300)
    try:
        assert b.batch_set(keys, recs) == [True] * 8
        srv.kill()
        out = [memoryview(bytearray(RECORD)) for _ in keys]
        assert b.batch_get(keys, out) == [False] * 8
        assert b.batch_exists(keys) == 0
        assert b.batch_set(keys, recs) == [False] * 8
        with pytest.raises(StorageUnavailable):
            b.delete(keys)
        with pytest.raises(StorageUnavailable):
            b.clear()
        s = b.stats()
        assert s.errors == 5
        assert (s.get_pages, s.get_hits, s.set_failures) == (8, 0, 8)
        assert s.stored_pages == -1
        # A client made while the server is down is fine, and so is closing it.
        srv.client(timeout_ms=100).close()
        srv.start()  # same port, empty memory tier
        wait_until(lambda: b.batch_set(keys, recs) == [True] * 8)
        assert b.batch_get(keys, out) == [True] * 8
        assert [bytes(o) for o in out] == [bytes(r) for r in recs]
        assert b.stats().stored_pages == 8
    finally:
        b.close()
        srv.stop()


# --------------------------------------------------------------------------------------------
# Metrics and logs
# --------------------------------------------------------------------------------------------


def test_metrics_and_lifecycle_logs(tmp_path: Path) -> None:
    mport = free_port()
    with hicache_server(tmp_path, metrics_port=mport) as srv:
        b = srv.client()
        c = codec()
        keys = [page_key("m", i) for i in range(3)]
        assert (
            b.batch_set(keys, [memoryview(page_record(c, "m", i)) for i in range(3)]) == [True] * 3
        )
        out = [memoryview(bytearray(RECORD)) for _ in range(4)]
        assert b.batch_get([*keys, "absent"], out) == [True, True, True, False]
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read()
        metrics = {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in text.decode().splitlines()
            if line and not line.startswith("#")
        }
        assert metrics["hicache_server_pages"] == 3
        assert metrics["hicache_server_bytes"] == 3 * RECORD
        assert metrics["hicache_server_hits_total"] == 3
        assert metrics["hicache_server_misses_total"] == 1
        assert metrics["hicache_server_evictions_total"] == 0
        assert metrics["hicache_server_connected_clients"] >= 1
        assert metrics['hicache_server_request_seconds_count{op="get"}'] == 1
        assert metrics['hicache_server_request_seconds_count{op="set"}'] == 1  # the commit
        assert metrics['hicache_server_request_seconds_count{op="reserve"}'] == 1
        b.close()
    log = srv.log()
    assert "listening on tcp://127.0.0.1:" in log
    assert "shutdown complete" in log


def test_get_with_repeated_keys(tmp_path: Path, raw: Callable[[str], RawClient]) -> None:
    """The server refuses a get naming a key twice (the page would be multiplied in the
    reply); the client asks for each key once and fills every buffer that asked for it."""
    c = codec()
    with hicache_server(tmp_path) as srv:
        b = srv.client()
        keys = [page_key("dup", i) for i in range(3)]
        recs = [page_record(c, "dup", i) for i in range(3)]
        assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * 3
        order = [0, 1, 0, 2, 0]
        out = [memoryview(bytearray(c.record_bytes)) for _ in order]
        assert b.batch_get([keys[i] for i in order], out) == [True] * 5
        assert [bytes(o) for o in out] == [bytes(recs[i]) for i in order]
        assert b.stats().errors == 0
        b.close()
        r = raw(srv.url).request(P.GetRequest(request_id=5, keys=[keys[0], keys[0]]))
        assert isinstance(r, P.ErrorReply)
        assert (r.code, r.request_id) == (P.ErrorCode.MALFORMED, 5)
