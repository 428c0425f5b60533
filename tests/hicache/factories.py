"""Small factories for core tests."""

from __future__ import annotations

from typing import Any

import torch

from hicache.config import HiCacheConfig
from hicache.hiradix import HiRadixCache
from hicache.memory_backend import MemoryBackend
from hicache.pools import DeviceKVPool
from hicache.simulation import SimStorage
from hicache_client.backend import StorageConfig


def sim_cache(
    *,
    page_size: int = 1,
    device_pages: int = 16,
    host_pages: int = 32,
    storage_pages: int | None | bool = False,
    **cfg: Any,
) -> HiRadixCache:
    """A simulated cache (no tensors). storage_pages: False = no L3, None = unbounded, N = cap."""
    cfg.setdefault("prefetch_threshold", 0)
    cfg.setdefault("load_back_threshold", 0)
    config = HiCacheConfig(page_size=page_size, simulated=True, **cfg)
    storage = None if storage_pages is False else SimStorage(storage_pages)  # type: ignore[arg-type]
    return HiRadixCache(
        config, num_device_pages=device_pages, num_host_pages=host_pages, sim_storage=storage
    )


def tensor_cache(
    *,
    page_size: int = 4,
    device_pages: int = 16,
    host_pages: int = 32,
    layers: int = 2,
    kv_heads: int = 2,
    head_dim: int = 4,
    dtype: torch.dtype = torch.float32,
    storage: bool | MemoryBackend = True,
    **cfg: Any,
) -> HiRadixCache:
    cfg.setdefault("prefetch_threshold", 0)
    cfg.setdefault("load_back_threshold", 0)
    config = HiCacheConfig(page_size=page_size, **cfg)
    pool = DeviceKVPool(
        num_pages=device_pages,
        page_size=page_size,
        num_layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
    )
    backend = None
    if storage is True:
        backend = MemoryBackend(StorageConfig())
    elif storage:
        backend = storage
    return HiRadixCache(config, device_pool=pool, num_host_pages=host_pages, storage=backend)


def run_request(cache: HiRadixCache, tokens: list[int], rid: str = "r", extra_key: str | None = None,
                fill: bool = False) -> tuple[list[int], int]:
    """Prefetch, acquire, compute (optionally writing random KV), insert, release.
    Returns (the tree's pages for the tokens, cached tokens at admission)."""
    cache.prefetch(rid, tokens, extra_key=extra_key)
    acq = cache.acquire(tokens, extra_key=extra_key, request_id=rid)
    need = len(tokens) // cache.page_size - len(acq.device_pages)
    new = cache.alloc_device(need) if need > 0 else []
    assert new is not None, "device pool exhausted in a test that expects room"
    if fill and new and cache.device_pool is not None:
        pool = cache.device_pool
        slots = pool.slots(new)
        pool.kv[:, :, slots] = torch.randn(pool.kv[:, :, slots].shape).to(pool.dtype)
    res = cache.insert(tokens, list(acq.device_pages) + new, extra_key=extra_key)
    cache.release(acq.node)
    return res.device_pages, acq.cached_tokens
