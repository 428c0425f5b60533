"""Factories for the SGLang plugin tests: SGLang's own storage config, host pools and backend
factory, and a real `hicache-server` (tests/storage_backends/hicache_server_proc.py)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integrations.sglang_env import (
    load_sglang_pools,
    mha_host_pool,
    mla_host_pool,
    sglang_skip_reason,
)
from tests.storage_backends.hicache_server_proc import HiCacheServerProc, hicache_server

SKIP = sglang_skip_reason()
PLUGIN = {"backend_name": "hicache", "module_path": "hicache_client.sglang",
          "class_name": "HiCacheServerStorage"}

__all__ = ["PLUGIN", "SKIP", "fill", "make_plugin", "mha_host_pool", "mla_host_pool",
           "page_bytes", "page_keys", "plugin", "server_fixture", "storage_config"]


def storage_config(url: str, *, model: str | None = "org/model", tp_rank: int = 0,
                   tp_size: int = 1, mla: bool = False, page_first: bool = True,
                   metrics: bool = False, **extra: Any) -> Any:
    """SGLang's `HiCacheStorageConfig` as its controller builds it, with our plugin in the
    extra config (`interface_v1` on unless `extra` says otherwise)."""
    s = load_sglang_pools()
    cfg = {**PLUGIN, "interface_v1": 1, "url": url, "timeout_ms": 2000, **extra}
    return s.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=metrics,
        is_page_first_layout=page_first, model_name=model, extra_config=cfg)


def make_plugin(cfg: Any, host: Any) -> Any:
    """What SGLang's `HiCacheController.attach_storage_backend` does: the factory builds the
    `dynamic` backend, then the host pool is registered."""
    s = load_sglang_pools()
    backend = s.StorageBackendFactory.create_backend("dynamic", cfg, host)
    backend.register_mem_pool_host(host)
    backend.on_host_pools_registered()
    return backend


def plugin(host: Any, url: str, **cfg: Any) -> Any:
    """The plugin SGLang attaches for `storage_config(url, **cfg)`, on `host`."""
    return make_plugin(storage_config(url, **cfg), host)


def fill(host: Any, n_pages: int, seed: int) -> tuple[torch.Tensor, list[bytes]]:
    """Allocate `n_pages` host pages, fill them with seeded random KV through SGLang's
    `set_from_flat_data_page`; return their slot indices and each page's flat bytes."""
    idx = host.alloc(n_pages * host.page_size)
    assert idx is not None, "host pool too small"
    gen = torch.Generator().manual_seed(seed)
    numel = host.get_dummy_flat_data_page().numel()
    for p in range(n_pages):
        page = torch.randn(numel, generator=gen).to(host.dtype)
        host.set_from_flat_data_page(int(idx[p * host.page_size]), page)
    return idx, [page_bytes(host, idx, p) for p in range(n_pages)]


def page_bytes(host: Any, idx: torch.Tensor, p: int) -> bytes:
    """The bytes of page `p` of slots `idx`, as SGLang's flat page (`get_data_page`)."""
    page = host.get_data_page(int(idx[p * host.page_size]), flat=True)
    return bytes(page.contiguous().view(torch.uint8).numpy())


def page_keys(n: int, seed: int, page_size: int = 16) -> list[str]:
    """SGLang's own storage keys (`get_hash_str`, chained per page) of a random prompt."""
    rng = random.Random(seed)
    tokens = [rng.randrange(32000) for _ in range(n * page_size)]
    keys = load_sglang_pools().get_hash_str(tokens, None, page_size=page_size)
    assert len(keys) == n
    return list(keys)


def server_fixture(tmp: Path, **kw: Any) -> Iterator[HiCacheServerProc]:
    with hicache_server(tmp, capacity="256MiB", **kw) as srv:
        yield srv


skip_without_sglang = pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
