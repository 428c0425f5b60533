"""KV bytes survive device -> host -> storage -> host -> device bit-identical, every layout."""

from __future__ import annotations

import pytest
import torch

from hicache.config import HiCacheConfig
from hicache.hiradix import HiRadixCache
from hicache.memory_backend import MemoryBackend
from hicache.pools import DeviceKVPool
from hicache_client.backend import StorageConfig
from hicache_client.registry import create_backend
from tests.hicache.factories import tensor_cache

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def kv_of(cache, pages):
    """The KV of `pages` as bytes (on the host): compared bit for bit, NaN patterns included."""
    pool = cache.device_pool
    return pool.kv[:, :, pool.slots(pages)].contiguous().view(torch.uint8).cpu()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("synchronous", [True, False])
def test_round_trip_all_tiers(layout, io_backend, dtype, synchronous):
    shared = f"rt-{layout}-{io_backend}-{dtype}-{synchronous}"
    cache = tensor_cache(mem_layout=layout, io_backend=io_backend, dtype=dtype,
                         synchronous=synchronous,
                         storage=MemoryBackend(StorageConfig(extra={"shared": shared})))
    check_all_tiers(cache, dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_round_trip_through_page_files(layout, dtype, tmp_path):
    """The same through the `file` backend (records on disk), fp8 included."""
    cache = tensor_cache(mem_layout=layout, dtype=dtype, synchronous=False,
                         storage=create_backend("file", StorageConfig(
                             extra={"path": str(tmp_path / "pages")})))
    check_all_tiers(cache, dtype)


def cuda_cache(layout: str, io_backend: str, dtype: torch.dtype, synchronous: bool, shared: str,
               storage: str = "memory", extra: dict | None = None):
    """A tiered cache with its device pool on CUDA, over the L3 backend `storage` (by name:
    `memory` shared under `shared`, or `file` with `extra`'s path)."""
    config = HiCacheConfig(page_size=4, mem_layout=layout, io_backend=io_backend,
                           synchronous=synchronous, prefetch_threshold=0, load_back_threshold=0)
    pool = DeviceKVPool(num_pages=16, page_size=4, num_layers=2, kv_heads=2, head_dim=4,
                        dtype=dtype, device="cuda")
    backend = create_backend(storage, StorageConfig(extra=extra or {"shared": shared}))
    return HiRadixCache(config, device_pool=pool, num_host_pages=32, storage=backend)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("storage", ["memory", "file"])
@pytest.mark.parametrize("synchronous", [True, False])
def test_gpu_round_trip_all_tiers(layout, io_backend, dtype, storage, synchronous, tmp_path):
    """The same round trip with the device pool on CUDA: pinned host pool, copies on the write
    and load streams, write acks from events; every layout x io backend x dtype, through the
    in-process store and through page files. Bit for bit."""
    if io_backend == "kernel":
        pytest.importorskip("triton")
    shared = f"gpu-rt-{layout}-{io_backend}-{dtype}-{synchronous}"
    extra = {"path": str(tmp_path / "pages")} if storage == "file" else None
    cache = cuda_cache(layout, io_backend, dtype, synchronous, shared, storage, extra)
    assert cache.host_pool.buffer.is_pinned()
    check_all_tiers(cache, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_async_write_through_under_eviction():
    """Write-through copies are in flight (events) while the forward goes on and eviction is
    asked for: locked nodes are not evicted before their ack, and what reaches host is exact."""
    cache = cuda_cache("page_first", "direct", torch.bfloat16, False, "gpu-wt-evict")
    pool = cache.device_pool
    kv = {}
    for i in range(3):
        tokens = list(range(100 * i, 100 * i + 16))
        pages = cache.alloc_device(4)
        pool.kv[:, :, pool.slots(pages)] = torch.randn(
            pool.kv[:, :, pool.slots(pages)].shape, device="cuda").to(torch.bfloat16)
        kv[i] = pool.kv[:, :, pool.slots(pages)].contiguous().view(torch.uint8).clone()
        cache.insert(tokens, pages)
        # The next "forward" overwrites other device memory on the compute stream meanwhile.
        pool.kv[:, :, pool.slots([15])] += 1  # (page 15 is never allocated here)
        cache.evict(1000)  # only nodes whose write was acked can go
        cache.check_integrity()
    cache.flush()
    cache.evict(1000)
    assert cache.usage()["device_pages_free"] == 16
    pool.kv.zero_()
    for i in range(3):
        acq = cache.acquire(list(range(100 * i, 100 * i + 16)))
        assert acq.host_hit_tokens == 16
        assert torch.equal(kv_of(cache, acq.device_pages), kv[i].cpu())
        cache.release(acq.node)
    cache.flush()
    cache.check_integrity(0)
    cache.close()


def check_all_tiers(cache, dtype):
    tokens = list(range(1000, 1024))  # 6 pages of 4
    pool = cache.device_pool
    pages = cache.alloc_device(6)
    # Random bit patterns of every byte value (NaN and inf encodings too), written as bytes.
    raw = pool.kv.view(torch.uint8)
    shape = raw[:, :, pool.slots(pages)].shape
    g = torch.Generator().manual_seed(3)
    raw[:, :, pool.slots(pages)] = torch.randint(0, 256, shape, dtype=torch.uint8,
                                                 generator=g).to(pool.device)
    original = kv_of(cache, pages)
    cache.insert(tokens, pages)
    cache.flush()
    assert cache.stats.storage_backup_pages == 6
    # Device -> host only: load back from L2.
    assert cache.evict(1000) == 24
    pool.kv.zero_()
    acq = cache.acquire(tokens)
    assert acq.host_hit_tokens == 24
    assert torch.equal(kv_of(cache, acq.device_pages), original)
    cache.release(acq.node)
    # Drop L1 and L2: everything comes back from L3 through the page records.
    cache.evict(1000)
    cache.evict_host(1000)
    assert list(cache.tree.nodes()) == []
    pool.kv.zero_()
    cache.host_pool.buffer.zero_()
    assert cache.prefetch("r", tokens) == 24
    cache.flush()
    acq = cache.acquire(tokens, request_id="r")
    assert acq.storage_hit_tokens == 24
    assert torch.equal(kv_of(cache, acq.device_pages), original)
    cache.release(acq.node)
    cache.flush()
    cache.check_integrity(0)
    cache.close()


def test_second_cache_reads_first_caches_pages():
    """Two instances on one store with the same namespace share pages."""
    shared = "two-instances"
    a = tensor_cache(synchronous=True, storage=MemoryBackend(StorageConfig(extra={"shared": shared})))
    b = tensor_cache(synchronous=True, storage=MemoryBackend(StorageConfig(extra={"shared": shared})))
    tokens = list(range(40))
    pages = a.alloc_device(10)
    a.device_pool.kv[:, :, a.device_pool.slots(pages)] = torch.randn(2, 2, 40, 2, 4)
    a.insert(tokens, pages)
    assert b.prefetch("r", tokens) == 40
    acq = b.acquire(tokens, request_id="r")
    assert torch.equal(kv_of(b, acq.device_pages), kv_of(a, pages))
    b.release(acq.node)


def test_corrupt_l3_page_is_a_counted_miss():
    backend = MemoryBackend(StorageConfig(extra={"shared": "corrupt"}))
    cache = tensor_cache(synchronous=True, storage=backend)
    tokens = list(range(16))
    pages = cache.alloc_device(4)
    cache.insert(tokens, pages)
    keys = cache.storage_keys(next(iter(cache.tree.nodes())))
    cache.evict(100)
    cache.evict_host(100)
    store = backend._store.data
    raw = bytearray(store[keys[2]])
    raw[-1] ^= 0x40
    store[keys[2]] = bytes(raw)
    assert cache.prefetch("r", tokens) == 16  # exists says all four are there
    acq = cache.acquire(tokens, request_id="r")
    assert acq.storage_hit_tokens == 8  # pages 0, 1; page 2 failed its checksum
    assert backend.stats().corrupt_pages == 1
    assert keys[2] not in store  # deleted
    cache.release(acq.node)
    cache.check_integrity(0)
