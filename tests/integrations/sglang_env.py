"""Loading SGLang's real KV pool classes on a machine without CUDA.

The plugin itself needs only `sglang.srt.mem_cache.hicache_storage` (the `HiCacheStorage` ABC),
which imports on any machine with `make setup`'s install. SGLang's device and host KV pools
(`memory_pool`, `pool_host`) also import its model-config registry (`sglang.srt.configs`),
several of whose modules import torchvision. PyPI has no CPU build of torchvision: the one
made for torch 2.13 (`make setup` puts it in `.venv/sglang-torchvision`, off sys.path) loads
its compiled operators against CUDA torch only, and without them its import stops at
`register_fake("torchvision::nms")` (and `qnms`), which needs the operators declared.

So, when torchvision does not import as installed, `load_sglang_pools()` declares those two
operator schemas (no kernel: a call raises "no kernel registered", nothing computes a wrong
answer) and imports it from that directory (on sys.path only for that import). Everything then
imported is SGLang's and torchvision's own code; the tests never call a torchvision operator.
Also used by benchmarks/integrations_sglang.py.
"""

from __future__ import annotations

import functools
import importlib
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

TORCHVISION_DIR = Path(sys.prefix) / "sglang-torchvision"
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_libs: list[Any] = []  # the declared schemas live as long as the process


def sglang_skip_reason() -> str | None:
    """Why the SGLang tests cannot run here (None: they can)."""
    try:
        importlib.import_module("sglang.srt.mem_cache.hicache_storage")
    except ImportError as e:
        return f"sglang does not import ({e}); run make setup"
    try:
        load_sglang_pools()
    except Exception as e:  # noqa: BLE001 - reported as the skip reason
        return f"SGLang's KV pool classes do not import here: {type(e).__name__}: {e}"
    return None


def _torchvision_imports() -> bool:
    try:
        importlib.import_module("torchvision")
    except Exception:  # noqa: BLE001 - ImportError, or RuntimeError from its operators
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        return False
    return True


def _declare_torchvision_ops() -> None:
    if _libs:
        return
    try:
        torch.ops.torchvision.nms.default  # noqa: B018 - declared already (a real torchvision)
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        lib.define(schema)
    _libs.append(lib)


@functools.lru_cache(maxsize=1)
def load_sglang_pools() -> SimpleNamespace:
    """SGLang's classes the tests and the benchmark use (imported once per process)."""
    if "torchvision" not in sys.modules and not _torchvision_imports():
        if not TORCHVISION_DIR.is_dir():
            raise ImportError(f"torchvision is not installed and {TORCHVISION_DIR} is missing "
                              "(make setup installs it)")
        _declare_torchvision_ops()
        # On sys.path only while torchvision imports: its later submodule imports go through
        # the package's own __path__, and processes this one spawns (multiprocessing copies
        # sys.path into them: the engine's TP ranks) must not find a torchvision whose
        # operators they have not declared.
        sys.path.append(str(TORCHVISION_DIR))
        try:
            importlib.import_module("torchvision")
        finally:
            sys.path.remove(str(TORCHVISION_DIR))
    from sglang.srt.mem_cache import hicache_storage
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_hash_str

    return SimpleNamespace(
        HiCacheStorageConfig=hicache_storage.HiCacheStorageConfig,
        HiCacheStorage=hicache_storage.HiCacheStorage,
        HiCacheFile=hicache_storage.HiCacheFile,
        StorageBackendFactory=StorageBackendFactory,
        MHATokenToKVPool=MHATokenToKVPool,
        MLATokenToKVPool=MLATokenToKVPool,
        MHATokenToKVPoolHost=MHATokenToKVPoolHost,
        MLATokenToKVPoolHost=MLATokenToKVPoolHost,
        get_hash_str=get_hash_str,
    )


def mha_host_pool(*, layout: str = "page_first", page_size: int = 16, layers: int = 2,
                  heads: int = 2, head_dim: int = 32, dtype: torch.dtype = torch.bfloat16,
                  pages: int = 16) -> Any:
    """A real SGLang MHA host pool (and the CPU device pool it mirrors) of `pages` pages."""
    s = load_sglang_pools()
    dev = s.MHATokenToKVPool(size=pages * page_size, page_size=page_size, dtype=dtype,
                             head_num=heads, head_dim=head_dim, layer_num=layers, device="cpu",
                             enable_memory_saver=False, enable_alt_stream=False)
    host = s.MHATokenToKVPoolHost(dev._mha_buffer_info(), 1.0, 0, page_size, layout,
                                  pin_memory=False, device="cpu",
                                  device_capacity_tokens=dev.size, start_layer=0,
                                  end_layer=layers)
    host._test_device_pool = dev  # the host pool's device pointers stay valid
    return host


def mla_host_pool(*, layout: str = "page_first", page_size: int = 16, layers: int = 2,
                  kv_lora_rank: int = 64, rope_dim: int = 16,
                  dtype: torch.dtype = torch.bfloat16, pages: int = 16) -> Any:
    """A real SGLang MLA host pool (and its CPU device pool) of `pages` pages."""
    s = load_sglang_pools()
    dev = s.MLATokenToKVPool(size=pages * page_size, page_size=page_size, dtype=dtype,
                             kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope_dim,
                             layer_num=layers, device="cpu", enable_memory_saver=False)
    host = s.MLATokenToKVPoolHost(dev._mla_buffer_info(), 1.0, 0, page_size, layout,
                                  pin_memory=False, device="cpu",
                                  device_capacity_tokens=dev.size, start_layer=0,
                                  end_layer=layers, target_layer_num=layers)
    host._test_device_pool = dev
    return host
