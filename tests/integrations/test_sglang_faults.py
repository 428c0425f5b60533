"""Bad input never reaches SGLang as an exception or a wrong page: a server that is away, a
refused token, a corrupt, foreign or misshapen record, bad host indices. Each is a miss
(`False`, `0`, `None`) and a count in `stats()`, exactly."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_client.codec import PageCodec
from hicache_client.errors import ConfigError
from tests.integrations import sglang_fixtures as sg
from tests.storage_backends.hicache_server_proc import HiCacheServerProc, RawClient

pytestmark = [pytest.mark.sglang, sg.skip_without_sglang]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[HiCacheServerProc]:
    yield from sg.server_fixture(tmp_path)


def _sentinel(host: Any, n: int) -> tuple[torch.Tensor, list[bytes]]:
    """`n` host pages filled with a known pattern, to show a miss leaves them alone."""
    return sg.fill(host, n, seed=4242)


def _counts(p: Any) -> tuple[int, int, int, int]:
    s = p.stats()
    return s["errors"], s["corrupt_pages"], s["plugin_errors"], s["get_hits"]


def test_server_away_then_back(server: HiCacheServerProc) -> None:
    host = sg.mha_host_pool(pages=24)
    p = sg.plugin(host, server.url, model="away", timeout_ms=500)
    try:
        keys = sg.page_keys(2, seed=30)
        idx, want = sg.fill(host, 2, seed=31)
        assert p.batch_set_v1(keys, idx) == [True, True]
        server.kill()
        assert p.batch_exists(keys) == 0
        assert p.stats()["errors"] == 1
        dst, before = _sentinel(host, 2)
        assert p.batch_get_v1(keys, dst) == [False, False]
        assert [sg.page_bytes(host, dst, i) for i in range(2)] == before
        assert p.batch_set_v1(keys, idx) == [False, False]
        assert p.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys]) == [None, None]
        assert p.batch_set(keys, [host.get_data_page(int(idx[0]))] * 2) is False
        assert p.exists(keys[0]) is False
        s = p.stats()
        assert (s["errors"], s["set_failures"], s["plugin_errors"], s["get_hits"]) == (6, 4, 0, 0)
        assert p.clear() is False  # administrative: not done, said so, still no exception
        server.start()  # same port, empty memory
        deadline = time.monotonic() + 20
        while p.batch_set_v1(keys, idx) != [True, True]:  # the breaker lets a probe through
            assert time.monotonic() < deadline, "the plugin never reconnected"
            time.sleep(0.1)
        dst = host.alloc(2 * 16)
        assert p.batch_get_v1(keys, dst) == [True, True]
        assert [sg.page_bytes(host, dst, i) for i in range(2)] == want
    finally:
        p.close()


def test_server_not_up_at_start(tmp_path: Path) -> None:
    srv = HiCacheServerProc(tmp_path, capacity="64MiB")
    host = sg.mha_host_pool()
    p = sg.plugin(host, srv.url, model="late", timeout_ms=300)
    try:
        keys = sg.page_keys(1, seed=32)
        idx, want = sg.fill(host, 1, seed=33)
        assert p.batch_set_v1(keys, idx) == [False]
        assert p.stats()["errors"] == 1
        srv.start()
        deadline = time.monotonic() + 20
        while p.batch_set_v1(keys, idx) != [True]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        dst = host.alloc(16)
        assert p.batch_get_v1(keys, dst) == [True]
        assert sg.page_bytes(host, dst, 0) == want[0]
    finally:
        p.close()
        srv.stop()


def test_wrong_token(tmp_path: Path) -> None:
    srv = HiCacheServerProc(tmp_path, capacity="64MiB", auth_token="s3cret").start()
    try:
        host = sg.mha_host_pool()
        with pytest.raises(ConfigError, match="refused"):  # a misconfigured engine: at start-up
            sg.plugin(host, srv.url, model="tok", auth_token="wrong")
        p = sg.plugin(host, srv.url, model="tok", auth_token="s3cret")
        keys = sg.page_keys(2, seed=34)
        idx, _ = sg.fill(host, 2, seed=35)
        assert p.batch_set_v1(keys, idx) == [True, True]
        srv.auth_token = "rotated"  # the server comes back with another token
        srv.restart()
        deadline = time.monotonic() + 20
        while p.stats()["errors"] == 0:  # the first call after the restart may wait a probe
            p.batch_exists(keys)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        e0 = p.stats()["errors"]
        assert p.batch_exists(keys) == 0
        dst, before = _sentinel(host, 2)
        assert p.batch_get_v1(keys, dst) == [False, False]
        assert [sg.page_bytes(host, dst, i) for i in range(2)] == before
        assert p.batch_set_v1(keys, idx) == [False, False]
        assert (p.stats()["errors"], p.stats()["plugin_errors"]) == (e0 + 3, 0)
        p.close()
    finally:
        srv.stop()


def _plant(server: HiCacheServerProc, key: str, record: bytes | bytearray) -> None:
    raw = RawClient(server.url)
    try:
        assert raw.set([key], [bytes(record)]) == [True]
    finally:
        raw.close()


def _stored(server: HiCacheServerProc, key: str) -> bytes:
    raw = RawClient(server.url)
    try:
        (rec,) = raw.get([key])
        assert rec is not None
        return rec
    finally:
        raw.close()


@pytest.mark.parametrize("shm", [True, False])
@pytest.mark.parametrize("fault", ["bit_flip", "truncated", "other_namespace", "other_format",
                                   "other_key"])
def test_bad_records_are_counted_misses(server: HiCacheServerProc, fault: str, shm: bool) -> None:
    """A bad record is a counted miss, deleted, and never a page reported as a hit. On the
    same host, a record is judged on its header (length, key, namespace, format) before its
    payload is copied into the host slot, so those faults leave the slot as it was; a record
    whose header is right but whose payload fails the checksum is found out after its copy,
    so the slot then holds those bytes, answered False (SGLang frees a slot answered False
    without reading it). Over TCP every record is checked before it reaches the slot."""
    host = sg.mha_host_pool(pages=24)
    p = sg.plugin(host, server.url, model=f"bad-{shm}", shm=shm)
    try:
        keys = sg.page_keys(2, seed=36)
        idx, want = sg.fill(host, 2, seed=37)
        assert p.batch_set_v1(keys, idx) == [True, True]
        sk = p._keys(keys)
        rec = bytearray(_stored(server, sk[0]))
        payload = bytes(rec[128:])
        pages = p.pages
        if fault == "bit_flip":
            rec[-1] ^= 0x01
        elif fault == "truncated":
            rec = rec[:-4096]
        elif fault == "other_namespace":
            rec = PageCodec(namespace=bytes(32), dtype=pages.codec.dtype,
                            shape=pages.codec.shape, layout=pages.codec.layout,
                            tokens_per_page=16, itemsize=2).encode(sk[0], payload)
        elif fault == "other_format":  # valid, ours, but not a page of this pool's format
            rec = PageCodec(namespace=p.namespace, dtype="uint8", shape=(len(payload),),
                            layout="raw", tokens_per_page=16, itemsize=1).encode(sk[0], payload)
        else:  # another page's record under this key
            rec = bytearray(_stored(server, sk[1]))
        _plant(server, sk[0], rec)
        dst, before = _sentinel(host, 2)
        assert p.batch_get_v1(keys, dst) == [False, True]
        if fault == "bit_flip" and shm:
            assert sg.page_bytes(host, dst, 0) == bytes(rec[128:])  # copied, then refused
        else:
            assert sg.page_bytes(host, dst, 0) == before[0]  # never copied into the slot
        assert sg.page_bytes(host, dst, 1) == want[1]
        # (a record of another format passes the client's checks and is refused by the
        # plugin's `accept`: corrupt, never a hit)
        assert _counts(p) == (0, 1, 0, 1)
        assert p.backend.arena.reads == (2 if shm else 0)
        assert p.batch_exists(keys) == 0  # the bad record is deleted
        assert p.batch_get(keys[1:], [host.get_dummy_flat_data_page()])[0] is not None
    finally:
        p.close()


def test_bad_calls_are_misses_not_exceptions(server: HiCacheServerProc) -> None:
    from tests.integrations.sglang_env import load_sglang_pools

    host = sg.mha_host_pool()
    cfg = sg.storage_config(server.url, model="calls")
    unregistered = load_sglang_pools().StorageBackendFactory.create_backend("dynamic", cfg, host)
    assert unregistered.batch_exists(sg.page_keys(1, seed=38)) == 0
    assert unregistered.batch_get_v1(sg.page_keys(1, seed=38), host.alloc(16)) == [False]
    assert unregistered.stats() == {"plugin_errors": 2, "skipped_sets": 0}
    p = sg.make_plugin(cfg, host)
    try:
        keys = sg.page_keys(2, seed=39)
        idx, _ = sg.fill(host, 2, seed=40)
        assert p.batch_set_v1(keys, idx[:17]) == [False, False]  # not 2 pages of slots
        assert p.batch_get_v1(keys, idx[:16]) == [False, False]
        assert p.batch_get(keys, [host.get_dummy_flat_data_page()]) == [None, None]
        assert p.batch_get(keys, [torch.zeros(3), torch.zeros(3)]) == [None, None]
        assert p.batch_set(keys, None) is False
        assert _counts(p) == (0, 0, 5, 0)
        assert p.batch_set_v1([], idx[:0]) == [] and p.batch_get_v1([], idx[:0]) == []
        assert p.batch_exists([]) == 0
        assert p.batch_exists(keys) == 0  # nothing was stored by the bad calls
    finally:
        p.close()
