"""`clear()` of the `hicache` backend removes its own namespace only (protocol 5,
`clear_namespace`); emptying the whole server is the admin's `clear_server()`.

A real `hicache-server` on a free loopback port, over its shared-memory store and over TCP, and
with persistence (pages on disk, read back after a restart).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_client.backend import StorageConfig
from hicache_client.errors import ConfigError
from hicache_client.remote.backend import HiCacheServerBackend
from tests.storage_backends.conftest import (
    assert_reads_back,
    buffers,
    make_codec,
    make_keys,
    make_records,
)
from tests.storage_backends.hicache_server_proc import HiCacheServerProc

NS_A, NS_B, NS_C = b"\xaa" * 32, b"\xbb" * 32, b"\xcc" * 32


def _client(url: str, ns: bytes | None, **extra: object) -> HiCacheServerBackend:
    return HiCacheServerBackend(StorageConfig(extra={"url": url, **extra},
                                              namespace=ns.hex() if ns else ""))


def _fill(b: HiCacheServerBackend, ns: bytes, salt: int, n: int = 4):  # type: ignore[no-untyped-def]
    codec = make_codec(2000, namespace=ns)
    keys = make_keys(n, salt=salt)
    recs = make_records(codec, keys, seed=salt)
    assert b.batch_set(keys, [memoryview(r) for r in recs]) == [True] * n
    return codec, keys, recs


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "tcp"])
def test_clear_removes_only_the_callers_namespace(tmp_path: Path, shm: bool) -> None:
    srv = HiCacheServerProc(tmp_path, capacity="64MiB").start()
    try:
        a, b, c = (_client(srv.url, ns, shm=shm) for ns in (NS_A, NS_B, NS_C))
        ca, ka, ra = _fill(a, NS_A, salt=1)
        cb, kb, rb = _fill(b, NS_B, salt=2)
        cc, kc, rc = _fill(c, NS_C, salt=3)
        assert a.server_stats()["pages"] == 12
        a.clear()
        assert a.batch_exists(ka) == 0
        assert a.batch_get(ka, buffers(4, ca.record_bytes)) == [False] * 4
        assert a.server_stats()["pages"] == 8
        assert_reads_back(b, cb, kb, rb)  # the other models' pages are all there
        assert_reads_back(c, cc, kc, rc)
        assert b.clear_namespace(NS_C) == 4  # another namespace, named explicitly
        assert c.batch_exists(kc) == 0
        assert_reads_back(b, cb, kb, rb)
        assert b.clear_namespace(NS_A) == 0  # nothing left there
        # A client that names no namespace refuses; the whole server is the admin's clear.
        anon = _client(srv.url, None, shm=shm)
        with pytest.raises(ConfigError, match="namespace"):
            anon.clear()
        assert b.batch_exists(kb) == 4
        anon.clear_server()
        assert b.batch_exists(kb) == 0
        assert b.server_stats()["pages"] == 0
        for x in (a, b, c, anon):
            x.close()
    finally:
        srv.stop()


def test_clear_reaches_the_persisted_pages(tmp_path: Path) -> None:
    srv = HiCacheServerProc(tmp_path, capacity="64MiB", persist_dir=tmp_path / "disk").start()
    try:
        a, b = _client(srv.url, NS_A), _client(srv.url, NS_B)
        _, ka, _ = _fill(a, NS_A, salt=4)
        cb, kb, rb = _fill(b, NS_B, salt=5)
        a.close()
        b.close()
        srv.stop()  # a clean stop writes the queue out: every page is on disk
        on_disk = sorted(p.name for p in (tmp_path / "disk").glob("*/*/*"))
        assert on_disk == sorted(ka + kb)
        srv.start()  # memory is empty: the pages are on disk only
        a, b = _client(srv.url, NS_A), _client(srv.url, NS_B)
        assert a.server_stats()["pages"] == 0
        assert a.clear_namespace(NS_A) == 4
        assert sorted(p.name for p in (tmp_path / "disk").glob("*/*/*")) == sorted(kb)
        assert a.batch_exists(ka) == 0
        assert_reads_back(b, cb, kb, rb)
        a.close()
        b.close()
    finally:
        srv.stop()
