"""The plugin under SGLang's own cache controller, with its threads running.

SGLang 0.5.23's scheduler builds a `HybridCacheController` for every model (plain KV too:
`build_kv_only_stack`); a speculative-decoding model's `draft` host pool joins it as a sidecar
(`register_host_pool_entry`, indices from the KV pool). Here that controller runs on CPU host
pools with its backup, prefetch, prefetch-IO and sync threads, against a real
`hicache-server`: one engine backs pages up (`write_storage` -> backup thread ->
`batch_set_v1` + `batch_set_v2`), another engine prefetches them (`prefetch` -> prefetch
thread -> `batch_exists_v2`; the test then does what the scheduler thread does with the hit:
allocates host slots and hands the operation to the prefetch-IO thread -> `batch_get_v1` +
`batch_get_v2`), and every page of both pools arrives byte for byte.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.integrations.sglang_fixtures import (
    PLUGIN,
    fill,
    mha_host_pool,
    page_bytes,
    server_fixture,
    skip_without_sglang,
)
from tests.storage_backends.hicache_server_proc import HiCacheServerProc

pytestmark = [pytest.mark.sglang, skip_without_sglang]
PAGE = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HiCacheServerProc]:
    yield from server_fixture(tmp_path_factory.mktemp("ctl"))


@pytest.fixture
def sglang_context() -> Iterator[None]:
    """What SGLang's launcher publishes before it builds a controller: its server args and this
    process's ranks (one rank: TP, PP, DCP and DP of size 1)."""
    from sglang.srt.runtime_context import get_context, get_parallel

    args = get_context().override_server_args()
    args.install()
    try:
        with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                     attn_dcp_rank=0, attn_dcp_size=1, attn_tp_rank=0,
                                     attn_tp_size=1, attn_dp_rank=0):
            yield
    finally:
        args.restore()


class Engine:
    """One SGLang engine's cache side: a `HybridCacheController` over a KV host pool (the
    anchor) with a `draft` host pool registered as SGLang's draft sidecar, the plugin attached
    as its `dynamic` storage backend."""

    def __init__(self, url: str) -> None:
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            HybridCacheController,
        )
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
        from sglang.srt.mem_cache.pool_host import HostPoolGroup

        self.kv = mha_host_pool(pages=16, layers=2)
        self.draft = mha_host_pool(pages=16, layers=1, heads=1)
        kv_dev, draft_dev = self.kv._test_device_pool, self.draft._test_device_pool
        group = HostPoolGroup([build_pool_entry(
            name=PoolName.KV, host_pool=self.kv, device_pool=kv_dev,
            layer_mapping={i: i for i in range(kv_dev.layer_num)},
            transfer_layer_id_max=kv_dev.layer_num, is_anchor=True)])
        self.cc = HybridCacheController(
            SimpleNamespace(get_kvcache=lambda: kv_dev), group, PAGE, None,
            load_cache_event=threading.Event(), storage_backend="dynamic",
            model_name="org/spec-model", transfer_layer_id_max=kv_dev.layer_num,
            storage_backend_extra_config={**PLUGIN, "interface_v1": 1, "url": url})
        # What `build_full_draft_pools` + `register_sidecar_pool` do for an EAGLE/MTP draft.
        self.cc.register_host_pool_entry(build_pool_entry(
            name=PoolName.DRAFT, host_pool=self.draft, device_pool=draft_dev,
            layer_mapping={0: 0}, transfer_layer_id_max=1))
        self.plugin = self.cc.storage_backend
        assert sorted(self.plugin.pools) == ["draft", "kv"]

    def draft_transfer(self) -> Any:
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

        return [PoolTransfer(name=PoolName.DRAFT, indices_from_pool=PoolName.KV)]

    def close(self) -> None:
        self.cc.detach_storage_backend()


def _tokens(n_pages: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (n_pages * PAGE,), generator=gen).tolist()


def _backup(e: Engine, tokens: list[int]) -> tuple[Any, list[bytes], list[bytes]]:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    n = len(tokens) // PAGE
    idx, kv_pages = fill(e.kv, n, seed=1)
    draft_pages = _fill_at(e.draft, idx, seed=2)
    hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
    e.cc.write_storage(idx, tokens, hash_value=hashes, extra_pools=e.draft_transfer())
    op = e.cc.ack_backup_queue.get(timeout=120)
    assert op.completed_tokens == n * PAGE
    assert dict(op.pool_storage_result.extra_pool_hit_pages) == {"draft": n}
    return hashes, kv_pages, draft_pages


def _fill_at(host: Any, idx: torch.Tensor, seed: int) -> list[bytes]:
    """Seeded random pages in `host` at the slots `idx` (the KV pool's: a KV-derived pool)."""
    gen = torch.Generator().manual_seed(seed)
    numel = host.get_dummy_flat_data_page().numel()
    n = idx.numel() // host.page_size
    for p in range(n):
        host.set_from_flat_data_page(int(idx[p * host.page_size]),
                                     torch.randn(numel, generator=gen).to(host.dtype))
    return [page_bytes(host, idx, p) for p in range(n)]


def _prefetch(e: Engine, tokens: list[int]) -> tuple[Any, int]:
    """What the scheduler does for a request whose prefix may be in L3: submit the prefetch,
    take the rank-agreed hit from the prefetch thread, allocate host slots for it and hand the
    operation to the prefetch-IO thread; then wait for its completion. Returns (the host
    slots, tokens completed)."""
    handle = SimpleNamespace(rid="req-1", attempt_id=0)
    op = e.cc.prefetch(handle, tokens, extra_pools=e.draft_transfer())
    hit = e.cc.prefetch_hit_queue.get(timeout=120)
    assert hit is op
    if op.storage_hit_count == 0:
        return None, 0
    host_indices, alloc = e.cc.allocate_storage_hit(
        op, op.storage_hit_count, allow_partial=True, min_tokens=PAGE, evict_host=lambda n: 0)
    assert alloc == op.storage_hit_count and host_indices is not None
    op.host_indices = host_indices
    e.cc.prefetch_buffer.put(op)
    done = 0
    while True:
        ack = e.cc.ack_prefetch_queue.get(timeout=120)
        if ack.completed_tokens is not None:
            done = ack.completed_tokens
        if ack.completed_req:
            return host_indices, done


@pytest.fixture
def engines(server: HiCacheServerProc, sglang_context: None) -> Iterator[tuple[Engine, Engine]]:
    """A writer and a reader engine on the one server, detached after the test."""
    writer, reader = Engine(server.url), Engine(server.url)
    try:
        yield writer, reader
    finally:
        writer.close()
        reader.close()


def test_draft_pool_round_trip_through_sglangs_controller(engines: tuple[Engine, Engine]) -> None:
    writer, reader = engines
    tokens = _tokens(5, seed=3)
    hashes, kv_pages, draft_pages = _backup(writer, tokens)
    host_indices, done = _prefetch(reader, tokens)
    assert done == 5 * PAGE
    assert [page_bytes(reader.kv, host_indices, p) for p in range(5)] == kv_pages
    assert [page_bytes(reader.draft, host_indices, p) for p in range(5)] == draft_pages
    s = reader.plugin.stats()
    assert (s["get_hits"], s["corrupt_pages"], s["plugin_errors"]) == (10, 0, 0)
    # Draft pages are records of their own namespace: the KV pool's keys do not find them.
    draft_ns = reader.plugin.pools["draft"].namespace
    assert draft_ns != reader.plugin.namespace
    assert reader.plugin.backend.batch_exists(reader.plugin._keys(hashes)) == 5


def test_a_missing_draft_page_shortens_the_hit(engines: tuple[Engine, Engine]) -> None:
    writer, reader = engines
    tokens = _tokens(6, seed=4)
    hashes, kv_pages, draft_pages = _backup(writer, tokens)
    drafts = writer.plugin.pools["draft"]
    writer.plugin.backend.delete(writer.plugin._keys(hashes[4:5], drafts))  # page 4's draft
    res = reader.plugin.batch_exists_v2(hashes, reader.draft_transfer())
    assert (res.kv_hit_pages, dict(res.extra_pool_hit_pages)) == (4, {"kv": 6, "draft": 4})
    host_indices, done = _prefetch(reader, tokens)
    assert done == 4 * PAGE  # KV holds 6 pages, but a request needs both pools
    assert [page_bytes(reader.draft, host_indices, p) for p in range(4)] == draft_pages[:4]
    assert [page_bytes(reader.kv, host_indices, p) for p in range(4)] == kv_pages[:4]


def test_clear_removes_this_engines_pools_only(
    server: HiCacheServerProc, sglang_context: None, tmp_path: Path
) -> None:
    from tests.integrations.sglang_fixtures import page_keys, plugin

    e = Engine(server.url)
    other = plugin(mha_host_pool(), server.url, model="org/other-model")
    try:
        hashes, _, _ = _backup(e, _tokens(3, seed=5))
        keys = page_keys(3, seed=6)
        idx, _ = fill(other.mem_pool_host, 3, seed=7)
        assert other.batch_set_v1(keys, idx) == [True] * 3
        assert e.cc.clear_storage_backend() is True  # SGLang's /clear_hicache_storage_backend
        res = e.plugin.batch_exists_v2(hashes, e.draft_transfer())
        assert res.kv_hit_pages == 0
        assert e.plugin.backend.batch_exists(
            e.plugin._keys(hashes, e.plugin.pools["draft"])) == 0
        assert other.batch_exists(keys) == 3  # another model's pages stay
    finally:
        other.close()
        e.close()


def test_extra_config_keys_sglang_owns_are_accepted(
    server: HiCacheServerProc, sglang_context: None
) -> None:
    """The prefill/decode-split decode side (`DecodeKVCacheOffloadManager`) hands SGLang's
    base `HiCacheController` the extra config as parsed, prefetch knobs included; a dynamic
    backend may also carry `"allocator": "shm"` and `file_storage_path`. All attach; a typo in
    one of ours is refused, naming it."""
    import json

    from sglang.srt.managers.cache_controller import HiCacheController

    from hicache_client.errors import ConfigError

    host = mha_host_pool()
    dev = host._test_device_pool
    extra = json.loads(json.dumps({
        **PLUGIN, "interface_v1": 1, "url": server.url, "allocator": "shm",
        "prefetch_threshold": 256, "prefetch_timeout_base": 1,
        "prefetch_timeout_per_ki_token": 0.25, "hicache_storage_pass_prefix_keys": True,
        "file_storage_path": "/unused", "tp_lcm_size": 1}))

    def controller(cfg: dict[str, Any]) -> Any:
        return HiCacheController(
            token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: dev),
            mem_pool_host=host, page_size=PAGE, tp_group=None,
            load_cache_event=threading.Event(), storage_backend="dynamic",
            model_name="org/model", storage_backend_extra_config=cfg)

    cc = controller(dict(extra))
    try:
        keys = [f"k{i}" for i in range(2)]
        idx, pages = fill(host, 2, seed=8)
        assert cc.storage_backend.batch_set_v1(keys, idx) == [True, True]
        assert cc.storage_backend.batch_exists(keys) == 2
    finally:
        cc.detach_storage_backend()
    with pytest.raises(ValueError, match=r"'timeout_mss': did you mean 'timeout_ms'\?") as e:
        controller({**extra, "timeout_mss": 10})
    assert isinstance(e.value.__cause__, ConfigError)  # SGLang wraps the attach error
