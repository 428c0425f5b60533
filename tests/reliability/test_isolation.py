"""Namespaces on one shared store: a different model fingerprint (`model_id`) or a different
`extra_key` (cache salt / tenant) never reads another namespace's pages, even for identical
token sequences; the same namespace does (the control that shows the store is shared)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from hicache.config import HiCacheConfig
from hicache.hiradix import HiRadixCache
from hicache.memory_backend import MemoryBackend
from hicache.pools import DeviceKVPool
from hicache_client.backend import StorageConfig
from hicache_client.keys import namespace_seed
from tests.hicache.factories import run_request
from tests.reliability import conftest as rel

PAGE = 4
TOKENS = list(range(100, 100 + 8 * PAGE))


def cache_for(model: str, shared: str) -> HiRadixCache:
    pool = DeviceKVPool(num_pages=32, page_size=PAGE, num_layers=2, kv_heads=2, head_dim=4)
    ns = namespace_seed(model_fingerprint=model, dtype="float32", page_size=PAGE,
                        layout="layer_first")
    cfg = HiCacheConfig(page_size=PAGE, prefetch_threshold=0, load_back_threshold=0,
                        synchronous=True)
    backend = MemoryBackend(StorageConfig(extra={"shared": shared}, namespace=ns.hex()))
    return HiRadixCache(cfg, device_pool=pool, num_host_pages=64, storage=backend, namespace=ns)


def test_hiradix_namespaces_never_share_pages() -> None:
    shared = f"isolation-{uuid.uuid4().hex}"
    a, b, a2 = cache_for("model-a", shared), cache_for("model-b", shared), cache_for("model-a",
                                                                                      shared)
    try:
        run_request(a, TOKENS, rid="a", fill=True)
        run_request(a, TOKENS, rid="a-salted", extra_key="tenant-1", fill=True)
        a.flush()
        assert a.storage_stats().stored_pages == 16  # type: ignore[union-attr]
        keys_a = a.storage_keys(a.match_prefix(TOKENS).last_device_node)
        # Another model: the same tokens name other keys, and nothing is found.
        assert b.prefetch("b", TOKENS) == 8 * PAGE  # asked of L3, which has none of its keys
        assert b.prefetch_progress("b") == (0, 0) and b.stats.prefetch_started == 0
        _, cached = run_request(b, TOKENS, rid="b")
        assert cached == 0 and b.stats.storage_hit_tokens == 0
        keys_b = b.storage_keys(b.match_prefix(TOKENS).last_device_node)
        assert not set(keys_a) & set(keys_b)
        # The same model with another salt, and no salt vs a salt, are namespaces apart too.
        for ek in ["tenant-2", None]:
            a2.prefetch(f"x{ek}", TOKENS, extra_key=ek)
            assert a2.prefetch_progress(f"x{ek}") == ((8, 8) if ek is None else (0, 0))
            a2.cancel_prefetch(f"x{ek}")
        assert a2.prefetch("t1", TOKENS, extra_key="tenant-1") == 8 * PAGE  # control
        acq = a2.acquire(TOKENS, extra_key="tenant-1", request_id="t1")
        assert acq.storage_hit_tokens == 8 * PAGE
        a2.release(acq.node)
        # Within one cache the tree is namespaced as well: no device hit across salts.
        assert a.match_prefix(TOKENS, extra_key="tenant-2").device_pages == []
        assert len(a.match_prefix(TOKENS, extra_key="tenant-1").device_pages) == 8
        # A hostile store handing model-a's record out under model-b's key: rejected, counted.
        sa = a.storage
        assert isinstance(sa, MemoryBackend)
        bufs = [memoryview(bytearray(a.codec.record_bytes))]  # type: ignore[union-attr]
        assert sa.batch_get(keys_a[:1], bufs) == [True]
        sb = b.storage
        assert isinstance(sb, MemoryBackend)
        sb.delete(keys_b)
        sb.raw_put(keys_b[0], bytes(bufs[0]))
        assert sb.batch_get(keys_b[:1], [memoryview(bytearray(len(bufs[0])))]) == [False]
        assert sb.stats().corrupt_pages == 1
        for c in (a, b, a2):
            c.check_integrity()
    finally:
        for c in (a, b, a2):
            c.close()


@pytest.mark.slow
def test_engine_namespaces_never_share_pages(tmp_path: Path, tiny_model: Path,
                                             reference: rel.Reference) -> None:
    extra = {"path": str(tmp_path / "pages")}
    prompts = rel.make_prompts(4, 80)
    with rel.storage_engine(tiny_model, "file", extra, model_id="model-a") as a:
        reference.assert_matches(a, prompts)
        reference.assert_matches(a, prompts, extra_key="salt-1")
        rel.settle(a)
        stored = rel.storage_stat(a, "stored_pages")
        # Same weights, same tokens, another model id: computed from scratch, nothing read.
        with rel.storage_engine(tiny_model, "file", extra, model_id="model-b") as b:
            reference.assert_matches(b, prompts)
            reference.assert_matches(b, prompts, extra_key="salt-1")
            assert rel.stat(b, "storage_hit_tokens") == 0
            assert rel.stat(b, "hit_tokens") == 0
            assert rel.storage_stat(b, "get_pages") == 0
            rel.settle(b)
            assert rel.storage_stat(b, "stored_pages") == 2 * stored
        # Same model id, another salt (or none vs a salt): nothing read either.
        reference.assert_matches(a, prompts, extra_key="salt-2")
        assert rel.stat(a, "storage_hit_tokens") == 0 and rel.stat(a, "hit_tokens") == 0
        # Control: the same model id and salt read the pages back.
        rel.settle(a)
        reference.assert_matches(a, prompts, extra_key="salt-1")
        assert rel.stat(a, "storage_hit_tokens") > 0
        assert rel.storage_stat(a, "corrupt_pages") == 0
