"""`hicache-server --persist-dir`: an acknowledged overwrite is never undone by a read.

Set X=A (persisted), set X=B (acknowledged), evict X from memory or crash, get X: the answer is
B or a miss, never A, whatever happened to B's persistence. One test per way B can fail to reach
the disk, each against a real server process:

- the write-behind queue is full (`--persist-queue 1 --persist-block-ms 0`): B is never queued;
- the disk is full: the server runs under RLIMIT_FSIZE, so B's write fails for real (EFBIG);
- a crash between write and rename: under RLIMIT_FSIZE with SIGXFSZ's default action, the
  kernel kills the server in the middle of writing B's temp file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_client.remote import protocol as P
from tests.procs import wait_until
from tests.storage_backends.hicache_server_proc import (
    HiCacheServerProc,
    RawClient,
    page_key,
    raw_clients,
)


@pytest.fixture
def clients() -> Iterator[list[RawClient]]:
    with raw_clients() as made:
        yield made


def _value(tag: bytes, i: int, size: int) -> bytes:
    head = tag + i.to_bytes(4, "little")
    return (head * (size // len(head) + 1))[:size]


def _settled(c: RawClient) -> bool:
    return c.stats()["persist_pending"] == 0


def _evict_all(c: RawClient, capacity: int, page: int) -> None:
    """Fill the memory tier with other pages until every earlier page is evicted."""
    n = 2 * capacity // page + 2
    for start in range(0, n, 16):
        keys = [page_key("filler", i) for i in range(start, min(n, start + 16))]
        assert all(c.set(keys, [_value(b"F", i, page) for i in range(len(keys))]))


def test_queue_full_overwrite_is_never_undone(tmp_path: Path, clients: list[RawClient]) -> None:
    capacity, page, n = 1 << 20, 4096, 200
    srv = HiCacheServerProc(
        tmp_path,
        capacity=str(capacity),
        persist_dir=tmp_path / "persist",
        args=["--persist-queue", "1", "--persist-block-ms", "0"],
    ).start()
    try:
        c = RawClient(srv.url)
        clients.append(c)
        keys = [page_key("x", i) for i in range(n)]
        a = [_value(b"A", i, page) for i in range(n)]
        b = [_value(b"B", i, page) for i in range(n)]
        for k, v in zip(keys, a):  # one at a time: every A reaches the disk
            assert c.set([k], [v]) == [True]
            wait_until(lambda: _settled(c), what="A persisted")
        assert c.stats()["persist_written"] == n
        # All B in one request: a queue of one page that may not wait drops most of them.
        assert c.set(keys, b) == [True] * n
        wait_until(lambda: _settled(c), what="B settled")
        dropped = c.stats()["persist_dropped"]
        assert dropped > 0
        _evict_all(c, capacity, page)
        got = c.get(keys)
        assert [g for g in got if g is not None and g not in b] == []  # no A, nothing else
        # Exactly the B that were not dropped were persisted and read back from disk.
        assert sum(g is None for g in got) == dropped
        assert all(g is None or g == v for g, v in zip(got, b))
    finally:
        srv.stop()
    assert "Traceback" not in srv.log()


def test_disk_full_overwrite_is_never_undone(tmp_path: Path, clients: list[RawClient]) -> None:
    capacity, small, big = 1 << 20, 4096, 64 << 10
    limit = 32 << 10  # A (4 KiB) fits under RLIMIT_FSIZE, B (64 KiB) cannot be written
    srv = HiCacheServerProc(
        tmp_path,
        capacity=str(capacity),
        persist_dir=tmp_path / "persist",
        file_size_limit=limit,
    ).start()
    try:
        c = RawClient(srv.url)
        clients.append(c)
        keys = [page_key("x", i) for i in range(8)]
        a = [_value(b"A", i, small) for i in range(8)]
        b = [_value(b"B", i, big) for i in range(8)]
        assert c.set(keys, a) == [True] * 8
        wait_until(lambda: _settled(c), what="A persisted")
        assert c.stats()["persist_written"] == 8
        assert c.set(keys, b) == [True] * 8  # acknowledged: in memory
        wait_until(lambda: _settled(c), what="B's writes failed")
        s = c.stats()
        assert (s["persist_written"], s["persist_failed"]) == (8, 8)
        assert c.get(keys) == b  # from memory
        _evict_all(c, capacity, small)
        assert c.get(keys) == [None] * 8  # B is gone with the memory; A must not come back
    finally:
        srv.stop()
    assert "Traceback" not in srv.log()


def test_crash_between_write_and_rename_never_serves_the_older_value(
    tmp_path: Path, clients: list[RawClient]
) -> None:
    small, big, limit = 4096, 64 << 10, 32 << 10
    persist = tmp_path / "persist"
    srv = HiCacheServerProc(
        tmp_path, persist_dir=persist, file_size_limit=limit, die_on_file_limit=True
    ).start()
    try:
        c = RawClient(srv.url)
        clients.append(c)
        key = page_key("x", 0)
        a, b = _value(b"A", 0, small), _value(b"B", 0, big)
        assert c.set([key], [a]) == [True]
        wait_until(lambda: _settled(c), what="A persisted")
        # Writing B's temp file crosses RLIMIT_FSIZE: the kernel kills the server there, before
        # the rename (the acknowledgement may or may not get out first).
        r = c.call(P.SetRequest(keys=[key], frames=[b]), timeout_ms=5000)
        assert r is None or (isinstance(r, P.SetReply) and r.stored == [True])
        assert srv.proc is not None
        srv.proc.proc.wait(timeout=60)  # type: ignore[union-attr]
        assert srv.proc.proc.returncode == -25  # type: ignore[union-attr]  # SIGXFSZ
        assert list(persist.rglob("*.tmp")), "the crash left B's half-written temp file"
        clients.pop().close()
        srv.file_size_limit = None
        srv.start()
        c = RawClient(srv.url)
        clients.append(c)
        assert c.get([key]) == [None]  # not A
        assert not list(persist.rglob("*.tmp"))  # the dead writer's temp file is cleaned up
    finally:
        srv.stop()
