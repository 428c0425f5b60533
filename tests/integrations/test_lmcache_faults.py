"""Bad input never reaches LMCache as an exception or as a wrong chunk: a dead server, a wrong
token, a corrupt record, a record of another namespace or format are each a miss (`None`,
`False`, `0`, a put reported not stored) and a counted error, with exact counts. Real server
processes (killed, restarted, started with a token); records tampered with through a plain
`HiCacheServerBackend` client of the same server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache_client.backend import StorageConfig
from hicache_client.remote.backend import HiCacheServerBackend
from tests.integrations.lmcache_fixtures import (
    ConnectorHarness,
    same_bits,
    skip_without_lmcache,
)
from tests.procs import wait_until
from tests.storage_backends.hicache_server_proc import HiCacheServerProc, hicache_server

pytestmark = [pytest.mark.lmcache, skip_without_lmcache]

COUNTS = ("errors", "corrupt_pages", "foreign_records", "chunks_hit", "chunks_not_stored",
          "failed_calls")


def counts(conn: Any) -> tuple[int, ...]:
    st = conn.getWrappedConnector().stats()
    return tuple(st[k] for k in COUNTS)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[HiCacheServerProc]:
    with hicache_server(tmp_path, capacity="128MiB", auth_token="right-token") as srv:
        yield srv


def harness_for(srv: HiCacheServerProc, **extra: Any) -> ConnectorHarness:
    return ConnectorHarness(f"hicache://127.0.0.1:{srv.port}",
                            **{"auth_token": "right-token", **extra})


@pytest.fixture
def raw(server: HiCacheServerProc) -> Iterator[HiCacheServerBackend]:
    """A plain client of the same server, to tamper with records."""
    b = HiCacheServerBackend(StorageConfig(extra={"url": server.url, "auth_token": "right-token",
                                                  "timeout_ms": 5000}))
    try:
        yield b
    finally:
        b.close()


def test_dead_server_is_a_counted_miss_and_recovery_is_automatic(
        server: HiCacheServerProc) -> None:
    h = harness_for(server, timeout_ms=300)
    try:
        conn = h.create()
        key, obj = h.key(1), h.chunk(seed=1)
        h.put(conn, [key], [obj])
        server.kill()
        assert h.run(conn.get(key)) is None
        assert conn.exists_sync(key) is False
        assert conn.batched_contains([key]) == 0
        h.put(conn, [h.key(2)], [obj])
        assert counts(conn) == (4, 0, 0, 0, 1, 0)  # one error per call, nothing raised
        assert h.run(conn.ping()) == 1

        server.start()  # same port, empty memory tier; no reconnect step anywhere
        wait_until(lambda: h.run(conn.ping()) == 0, timeout=20.0, interval=0.02)
        h.put(conn, [h.key(3)], [obj])
        h.assert_holds(conn, h.key(3), obj.tensor)
        obj.ref_count_down()
    finally:
        h.close()


def test_wrong_token_is_a_counted_miss(server: HiCacheServerProc) -> None:
    good, bad = harness_for(server), harness_for(server, auth_token="wrong-token")
    try:
        writer = good.create()
        key, obj = good.key(7), good.chunk(seed=7)
        good.put(writer, [key], [obj])
        stranger = bad.create()  # the refusal at start-up is logged and counted, not raised
        assert counts(stranger) == (1, 0, 0, 0, 0, 0)
        assert bad.run(stranger.get(key)) is None
        assert stranger.exists_sync(key) is False
        bad.put(stranger, [key], [obj])
        assert counts(stranger) == (4, 0, 0, 0, 1, 0)
        assert bad.run(stranger.ping()) == 2
        good.assert_holds(writer, key, obj.tensor)  # the refused put changed nothing
        obj.ref_count_down()
    finally:
        bad.close()
        good.close()


def test_corrupt_records_are_counted_dropped_and_deleted(
        server: HiCacheServerProc, raw: HiCacheServerBackend) -> None:
    h = harness_for(server)
    try:
        conn = h.create()
        inner = conn.getWrappedConnector()
        keys = [h.key(i) for i in (21, 22, 23)]
        objs = [h.chunk(seed=i) for i in (21, 22, 23)]
        h.put(conn, keys, objs)
        skeys = [inner.storage_key(k) for k in keys]
        record = bytearray(inner.layout.record_bytes)
        assert raw.batch_get(skeys[:1], [memoryview(record)]) == [True]
        flipped = bytearray(record)
        flipped[-1] ^= 0x40  # one bit of the payload
        assert raw.batch_set(skeys[:2], [memoryview(flipped), memoryview(record[:-1])]) == [
            True, True]  # a flipped bit; a truncated record
        got = h.run(conn.batched_get(keys))
        assert got[0] is None and got[1] is None and got[2] is not None
        assert same_bits(got[2].tensor, objs[2].tensor)
        got[2].ref_count_down()
        assert counts(conn) == (0, 2, 0, 1, 0, 0)
        assert conn.batched_contains(keys[:1]) == 0 and not conn.exists_sync(keys[1])  # deleted
        for o in objs:
            o.ref_count_down()
    finally:
        h.close()


def test_records_of_another_namespace_or_format_are_never_handed_out(
        server: HiCacheServerProc, raw: HiCacheServerBackend) -> None:
    """A well-formed record (right checksum, right key digest) stored under our key by someone
    else: another namespace, or our namespace with another dtype, or a token count too large."""
    from hicache_client.codec import PageCodec
    from hicache_client.lmcache.records import ChunkLayout

    h = harness_for(server)
    try:
        conn = h.create()
        inner = conn.getWrappedConnector()
        layout: ChunkLayout = inner.layout
        keys = [h.key(i) for i in (31, 32, 33)]
        skeys = [inner.storage_key(k) for k in keys]
        payload = memoryview(bytes(range(256)) * (layout.payload_bytes // 256))
        foreign = PageCodec(namespace=b"\x07" * 32, dtype=layout.dtypes[0],
                            shape=layout.shapes[0], layout="raw",
                            tokens_per_page=layout.chunk_tokens, itemsize=2).encode(
            skeys[0], payload)
        seed = inner.namespace(keys[1])
        wrong_dtype = PageCodec(namespace=seed, dtype="bfloat16", shape=layout.shapes[0],
                                layout="raw", tokens_per_page=16, itemsize=2).encode(
            skeys[1], payload)
        too_long = PageCodec(namespace=seed, dtype=layout.dtypes[0], shape=layout.shapes[0],
                             layout="raw", tokens_per_page=layout.chunk_tokens + 1,
                             itemsize=2).encode(skeys[2], payload)
        assert raw.batch_set(skeys, [memoryview(foreign), memoryview(wrong_dtype),
                                     memoryview(too_long)]) == [True, True, True]
        assert conn.batched_contains(keys) == 3  # present, but not ours
        assert h.run(conn.batched_get(keys)) == [None, None, None]
        assert counts(conn) == (0, 3, 3, 0, 0, 0)
        assert conn.batched_contains(keys) == 0  # deleted
    finally:
        h.close()
