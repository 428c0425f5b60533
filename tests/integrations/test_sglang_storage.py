"""The plugin through SGLang's own interface: built by SGLang's `StorageBackendFactory`
(`dynamic`), given SGLang's real host KV pools (MHA and MLA, every host layout, on CPU), and
driven with the calls SGLang's cache controller makes, against a real `hicache-server`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_client.errors import ConfigError
from tests.integrations.sglang_fixtures import (
    fill,
    make_plugin,
    mha_host_pool,
    mla_host_pool,
    page_bytes,
    page_keys,
    plugin,
    server_fixture,
    skip_without_sglang,
    storage_config,
)
from tests.storage_backends.hicache_server_proc import HiCacheServerProc

pytestmark = [pytest.mark.sglang, skip_without_sglang]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HiCacheServerProc]:
    yield from server_fixture(Path(tmp_path_factory.mktemp("sglang-storage")))


def _round_trip(b: Any, host: Any, n: int, seed: int) -> None:
    """`n` pages (keys of prompt `seed`, KV of seed `seed + 1`) set from their host slots, then
    got into fresh slots: every one a hit, byte-exact."""
    keys = page_keys(n, seed=seed)
    idx, want = fill(host, n, seed=seed + 1)
    assert b.batch_set_v1(keys, idx) == [True] * n
    dst = host.alloc(n * 16)
    assert b.batch_get_v1(keys, dst) == [True] * n
    assert [page_bytes(host, dst, p) for p in range(n)] == want


def test_sglang_factory_builds_the_plugin(server: HiCacheServerProc) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    from hicache_client.sglang import HiCacheServerStorage

    host = mha_host_pool()
    b = plugin(host, server.url)
    try:
        assert type(b) is HiCacheServerStorage and isinstance(b, HiCacheStorage)
        assert b.mem_pool_host is host and b.pages is not None
        assert b.pages.payload_bytes == host.get_dummy_flat_data_page().numel() * 2
    finally:
        b.close()


@pytest.mark.parametrize(("kind", "layout"), [
    ("mha", "layer_first"), ("mha", "page_first"), ("mha", "page_first_direct"),
    ("mha", "page_head"), ("mla", "layer_first"), ("mla", "page_first"),
    ("mla", "page_first_direct"),
])
def test_v1_round_trip_is_byte_exact(server: HiCacheServerProc, kind: str, layout: str) -> None:
    """One engine backs pages up from its host pool; another (its own pool and plugin) loads
    them into other slots: every byte of every page arrives."""
    make = mha_host_pool if kind == "mha" else mla_host_pool
    a_host, b_host = make(layout=layout), make(layout=layout)
    cfg = storage_config(server.url, model=f"rt-{kind}-{layout}", mla=kind == "mla")
    a, b = make_plugin(cfg, a_host), make_plugin(cfg, b_host)
    try:
        keys = page_keys(5, seed=1)
        src, want = fill(a_host, 5, seed=2)
        assert a.batch_set_v1(keys, src) == [True] * 5
        b_host.alloc(16)  # other slots than the writer's
        dst = b_host.alloc(5 * 16)
        assert b.batch_exists(keys) == 5
        assert b.batch_get_v1(keys, dst) == [True] * 5
        assert [page_bytes(b_host, dst, p) for p in range(5)] == want
        sa, sb = a.stats(), b.stats()
        assert (sa["set_pages"], sa["set_failures"], sa["errors"]) == (5, 0, 0)
        assert (sb["get_pages"], sb["get_hits"], sb["errors"], sb["corrupt_pages"]) == (5, 5, 0, 0)
        assert sb["bytes_read"] == 5 * b.pages.record_bytes
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_v0_and_v1_read_each_others_pages(server: HiCacheServerProc, layout: str) -> None:
    """The v0 tensor calls (SGLang's generic page path) and the v1 zero-copy calls store the
    same record: SGLang's flat page bytes."""
    host = mha_host_pool(layout=layout)
    b = plugin(host, server.url, model=f"v0v1-{layout}")
    try:
        keys = page_keys(4, seed=3)
        idx, want = fill(host, 4, seed=4)
        assert b.batch_set_v1(keys[:2], idx[: 2 * 16]) == [True, True]
        pages = [host.get_data_page(int(idx[p * 16])) for p in (2, 3)]
        assert b.batch_set(keys[2:], pages) is True  # v0, as _generic_page_set calls it
        dummies = [host.get_dummy_flat_data_page() for _ in keys]
        got = b.batch_get(keys, dummies)  # v0, as _generic_page_get calls it
        assert all(g is d for g, d in zip(got, dummies))
        assert [bytes(g.view(torch.uint8).numpy()) for g in got] == want
        dst = host.alloc(4 * 16)
        assert b.batch_get_v1(keys, dst) == [True] * 4
        assert [page_bytes(host, dst, p) for p in range(4)] == want
        assert b.exists(keys[3]) and not b.exists(page_keys(1, seed=99)[0])
        one = b.get(keys[0], host.get_dummy_flat_data_page())
        assert one is not None and bytes(one.view(torch.uint8).numpy()) == want[0]
        assert b.get(page_keys(1, seed=98)[0], host.get_dummy_flat_data_page()) is None
        assert b.stats()["errors"] == 0
    finally:
        b.close()


def test_prefix_semantics(server: HiCacheServerProc) -> None:
    """`batch_exists` counts the leading run; a get answers per key (SGLang's controller then
    uses the leading run of hits)."""
    host = mha_host_pool()
    b = plugin(host, server.url, model="prefix")
    try:
        keys = page_keys(5, seed=5)
        idx, want = fill(host, 5, seed=6)
        stored = [0, 1, 3]
        assert b.batch_set_v1([keys[i] for i in stored],
                              torch.cat([idx[i * 16 : (i + 1) * 16] for i in stored])) == [True] * 3
        assert b.batch_exists(keys) == 2
        assert b.batch_exists(keys[3:]) == 1
        dst = host.alloc(5 * 16)
        assert b.batch_get_v1(keys, dst) == [True, True, False, True, False]
        assert [page_bytes(host, dst, p) for p in (0, 1, 3)] == [want[i] for i in (0, 1, 3)]
    finally:
        b.close()


def test_a_batch_larger_than_the_staging_area_goes_in_parts(server: HiCacheServerProc) -> None:
    host = mha_host_pool(pages=24)
    b = plugin(host, server.url, model="parts", stage_bytes=20_000)
    try:
        assert b.pages.record_bytes == 8320 and b._call_pages == 2  # two records per part
        _round_trip(b, host, 11, seed=7)
    finally:
        b.close()


@pytest.mark.parametrize("shm", [True, False])
def test_same_host_shared_memory_by_default(server: HiCacheServerProc, shm: bool) -> None:
    host = mha_host_pool()
    extra = {} if shm else {"shm": False}
    b = plugin(host, server.url, model=f"shm-{shm}", **extra)
    try:
        _round_trip(b, host, 3, seed=9)
        arena = b.backend.arena
        assert (arena.writes, arena.reads) == ((3, 3) if shm else (0, 0))
    finally:
        b.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_v1_pages_move_in_one_copy(server: HiCacheServerProc, layout: str) -> None:
    """Same host: a set copies each page's regions straight into the server's store and a get
    copies them straight back into the host slots (the record's header goes through a small
    per-thread buffer): no record is assembled anywhere, no page byte crosses the region or
    TCP, and the client's temporaries are never made."""
    host = mha_host_pool(layout=layout)
    b = plugin(host, server.url, model=f"one-copy-{layout}")
    try:
        regions = len(b.pages.region_sizes)
        assert regions == (2 * 2 if layout == "layer_first" else 2)  # K and V (per layer)
        keys = page_keys(4, seed=13)
        idx, want = fill(host, 4, seed=14)
        before = b.backend.server_stats()
        assert b.batch_set_v1(keys, idx) == [True] * 4
        dst = host.alloc(4 * 16)
        assert b.batch_get_v1(keys, dst) == [True] * 4
        assert [page_bytes(host, dst, p) for p in range(4)] == want
        st = b.backend.server_stats()
        moved = {k: st[k] - before[k] for k in st if k.endswith("page_bytes_in")
                 or k.endswith("page_bytes_out")}
        n = 4 * b.pages.record_bytes
        assert moved == {"store_page_bytes_in": n, "store_page_bytes_out": n,
                         "shm_page_bytes_in": 0, "shm_page_bytes_out": 0,
                         "tcp_page_bytes_in": 0, "tcp_page_bytes_out": 0}
        assert (b.backend.arena.writes, b.backend.arena.reads) == (4, 4)
        assert b.backend._scratch_buffers.held() == 0  # no record went through a temporary
    finally:
        b.close()


def test_storage_metrics_for_sglang(server: HiCacheServerProc) -> None:
    host = mha_host_pool()
    b = plugin(host, server.url, model="metrics", metrics=True)
    try:
        keys = page_keys(4, seed=11)
        idx, _ = fill(host, 4, seed=12)
        b.batch_set_v1(keys, idx)
        b.batch_get_v1(keys, host.alloc(4 * 16))
        m = b.get_stats()
        assert (m.prefetch_pgs, m.backup_pgs) == ([4], [4])
        assert m.prefetch_bandwidth[0] > 0 and m.backup_bandwidth[0] > 0
        again = b.get_stats()  # drained on read, as SGLang's backends do
        assert (again.prefetch_pgs, again.backup_pgs) == ([], [])
    finally:
        b.close()


def test_configuration_errors_at_start_up(server: HiCacheServerProc) -> None:
    host = mha_host_pool()
    with pytest.raises(ConfigError, match="unknown extra-config keys"):
        plugin(host, server.url, timeout=5)
    with pytest.raises(ConfigError, match="model"):
        plugin(host, server.url, model=None)
    b = plugin(host, server.url, model=None, model_id="my-model")
    b.close()
