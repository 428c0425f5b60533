"""Who shares pages: the namespace from SGLang's storage config. MHA ranks each keep their own
pages; MLA ranks hold the same KV, so one rank writes and every rank reads; another model,
dtype, layout or salt never reads a page that is not its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integrations import sglang_fixtures as sg
from tests.storage_backends.hicache_server_proc import HiCacheServerProc

pytestmark = [pytest.mark.sglang, sg.skip_without_sglang]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HiCacheServerProc]:
    yield from sg.server_fixture(Path(tmp_path_factory.mktemp("sglang-ranks")))


def _close(*plugins: Any) -> None:
    for p in plugins:
        p.close()


def test_mha_ranks_keep_their_own_pages(server: HiCacheServerProc) -> None:
    """TP ranks of one MHA model store their head shards under the same SGLang keys: each reads
    back its own shard, never another rank's."""
    hosts = [sg.mha_host_pool(), sg.mha_host_pool()]
    ranks = [sg.plugin(h, server.url, model="tp-mha", tp_rank=r, tp_size=2)
             for r, h in enumerate(hosts)]
    try:
        keys = sg.page_keys(3, seed=20)
        wants = []
        for r, (p, h) in enumerate(zip(ranks, hosts)):
            idx, want = sg.fill(h, 3, seed=100 + r)
            assert p.batch_set_v1(keys, idx) == [True] * 3
            wants.append(want)
        assert wants[0] != wants[1]
        for p, h, want in zip(ranks, hosts, wants):
            dst = h.alloc(3 * 16)
            assert p.batch_get_v1(keys, dst) == [True] * 3
            assert [sg.page_bytes(h, dst, i) for i in range(3)] == want
        assert ranks[0].namespace != ranks[1].namespace
        # a rank of a 4-way deployment holds other heads: it finds nothing of the 2-way one
        other = sg.plugin(sg.mha_host_pool(), server.url, model="tp-mha", tp_rank=0, tp_size=4)
        assert other.batch_exists(keys) == 0
        assert other.stats()["errors"] == 0
        other.close()
    finally:
        _close(*ranks)


@pytest.mark.parametrize("change", ["model", "dtype", "layout", "salt", "geometry"])
def test_another_universe_never_reads_these_pages(server: HiCacheServerProc, change: str) -> None:
    host = sg.mha_host_pool()
    writer = sg.plugin(host, server.url, model="universe")
    keys = sg.page_keys(2, seed=21)
    idx, _ = sg.fill(host, 2, seed=22)
    assert writer.batch_set_v1(keys, idx) == [True, True]
    kw: dict[str, Any] = {"model": "universe"}
    pool_kw: dict[str, Any] = {}
    if change == "model":
        kw["model"] = "another/model"
    elif change == "dtype":
        pool_kw["dtype"] = torch.float16
    elif change == "layout":
        pool_kw["layout"] = "page_first_direct"
    elif change == "salt":
        kw["namespace_salt"] = "tenant-b"
    else:
        pool_kw["heads"] = 4  # same model name, other page shape
    reader_host = sg.mha_host_pool(**pool_kw)
    reader = sg.plugin(reader_host, server.url, **kw)
    try:
        assert reader.namespace != writer.namespace
        assert reader.batch_exists(keys) == 0
        assert reader.batch_get_v1(keys, reader_host.alloc(2 * 16)) == [False, False]
        s = reader.stats()
        assert (s["get_hits"], s["errors"], s["corrupt_pages"]) == (0, 0, 0)
    finally:
        _close(writer, reader)


def test_model_id_names_the_model_across_paths(server: HiCacheServerProc) -> None:
    """Engines that load one model from different paths share pages with one `model_id`."""
    h1, h2 = sg.mha_host_pool(), sg.mha_host_pool()
    a = sg.plugin(h1, server.url, model="/mnt/a/llama", model_id="llama-3-8b")
    b = sg.plugin(h2, server.url, model="/mnt/b/llama", model_id="llama-3-8b")
    try:
        keys = sg.page_keys(2, seed=23)
        idx, want = sg.fill(h1, 2, seed=24)
        assert a.batch_set_v1(keys, idx) == [True, True]
        dst = h2.alloc(2 * 16)
        assert b.batch_get_v1(keys, dst) == [True, True]
        assert [sg.page_bytes(h2, dst, i) for i in range(2)] == want
    finally:
        _close(a, b)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mla_one_writer_every_rank_reads(server: HiCacheServerProc, layout: str) -> None:
    """MLA KV is the same on every TP rank: rank 0 stores it, ranks 1..3 answer their sets
    without writing, and all four read rank 0's pages."""
    hosts = [sg.mla_host_pool(layout=layout) for _ in range(4)]
    model = f"mla-{layout}"
    ranks = [sg.plugin(h, server.url, model=model, mla=True, tp_rank=r, tp_size=4)
             for r, h in enumerate(hosts)]
    try:
        assert len({p.namespace for p in ranks}) == 1
        keys = sg.page_keys(3, seed=25)
        filled = [sg.fill(h, 3, seed=200 + r) for r, h in enumerate(hosts)]
        # the readers first: nothing is written by them
        for p, (idx, _) in zip(ranks[1:], filled[1:]):
            assert p.batch_set_v1(keys, idx) == [True] * 3
            assert p.batch_set(keys, [p.mem_pool_host.get_data_page(int(idx[i * 16]))
                                      for i in range(3)]) is True
        assert ranks[0].batch_exists(keys) == 0
        assert ranks[0].batch_set_v1(keys, filled[0][0]) == [True] * 3
        want = filled[0][1]
        for p, h in zip(ranks, hosts):
            dst = h.alloc(3 * 16)
            assert p.batch_exists(keys) == 3
            assert p.batch_get_v1(keys, dst) == [True] * 3
            assert [sg.page_bytes(h, dst, i) for i in range(3)] == want
        assert [p.stats()["skipped_sets"] for p in ranks] == [0, 6, 6, 6]
        assert [p.stats()["set_pages"] for p in ranks] == [3, 0, 0, 0]
        # an MLA deployment of another TP width holds the same KV: it reads these pages
        wide = sg.plugin(sg.mla_host_pool(layout=layout), server.url, model=model, mla=True,
                         tp_rank=5, tp_size=8)
        assert wide.batch_exists(keys) == 3
        wide.close()
    finally:
        _close(*ranks)


def test_mla_and_mha_pages_never_mix(server: HiCacheServerProc) -> None:
    mha_host, mla_host = sg.mha_host_pool(), sg.mla_host_pool()
    a = sg.plugin(mha_host, server.url, model="mix")
    b = sg.plugin(mla_host, server.url, model="mix", mla=True)
    try:
        keys = sg.page_keys(2, seed=26)
        assert a.batch_set_v1(keys, sg.fill(mha_host, 2, seed=27)[0]) == [True, True]
        assert b.batch_exists(keys) == 0
    finally:
        _close(a, b)
