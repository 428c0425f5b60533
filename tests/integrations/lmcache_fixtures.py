"""Factories for the LMCache connector tests: LMCache's own engine config and metadata, a CPU
"GPU connector" that copies between a plain CPU KV tensor and LMCache's chunks, engines built
with LMCache's `LMCacheEngineBuilder`, and connectors built with LMCache's `CreateConnector`
(the same path `RemoteBackend` takes) over a real `LocalCPUBackend`.

Nothing of LMCache or of the server is mocked: CUDA is the only thing missing here, so the one
piece we supply is the copy between the serving engine's KV and LMCache's `MemoryObj`s, which
on a GPU is LMCache's CUDA kernel (`lmcache.c_ops`) and here is `CPUKVConnector`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.procs import wait_until  # noqa: E402

PLUGIN = "hicache"
ADAPTER = {
    "remote_storage_plugin.hicache.module_path": "hicache_client.lmcache.adapter",
    "remote_storage_plugin.hicache.class_name": "HiCacheConnectorAdapter",
}
CHUNK = 16  # tokens per LMCache chunk in these tests
LAYERS, HEADS, HEAD_DIM = 2, 2, 8


def lmcache_skip_reason() -> str | None:
    try:
        import lmcache.v1.cache_engine  # noqa: F401
    except ImportError as e:
        return f"lmcache is not installed ({e}): pip install 'hicache[lmcache]'"
    return None


skip_without_lmcache = pytest.mark.skipif(lmcache_skip_reason() is not None,
                                          reason=str(lmcache_skip_reason()))


def settings(url: str, **extra: Any) -> dict[str, Any]:
    """The extra_config that plugs our connector into LMCache (docs/lmcache.md)."""
    cfg: dict[str, Any] = {**ADAPTER, "remote_storage_plugin.hicache.url": url,
                           "remote_storage_plugin.hicache.timeout_ms": 5000}
    cfg.update({f"remote_storage_plugin.hicache.{k}": v for k, v in extra.items()})
    return cfg


def engine_config(url: str, extra_config: dict[str, Any] | None = None, **kw: Any) -> Any:
    """An `LMCacheEngineConfig` whose only remote tier is our plugin, with no local CPU hot
    cache (so every read goes to the server)."""
    from lmcache.v1.config import LMCacheEngineConfig

    args: dict[str, Any] = dict(chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05,
                                save_unfull_chunk=True, remote_serde="naive",
                                remote_storage_plugins=[PLUGIN])
    args.update(kw)
    return LMCacheEngineConfig.from_defaults(**args,
                                             extra_config={**settings(url), **(extra_config or {})})


def metadata(*, worker_id: int = 0, world_size: int = 1, use_mla: bool = False,
             model: str = "demo-model", dtype: torch.dtype = torch.float16) -> Any:
    from lmcache.v1.metadata import LMCacheMetadata

    kv = 1 if use_mla else 2
    heads = 1 if use_mla else HEADS
    return LMCacheMetadata(model_name=model, world_size=world_size, local_world_size=world_size,
                           worker_id=worker_id, local_worker_id=worker_id, kv_dtype=dtype,
                           kv_shape=(LAYERS, kv, CHUNK, heads, HEAD_DIM), use_mla=use_mla,
                           chunk_size=CHUNK)


def kv_cache(tokens: int, seed: int, md: Any) -> torch.Tensor:
    """A serving engine's KV for `tokens` tokens: [layers, kv, tokens, hidden], random bits."""
    layers, kv, _, heads, head_dim = md.kv_shape
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, kv, tokens, heads * head_dim, generator=g).to(md.kv_dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


def _connector_class() -> type:
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    class CPUKVConnector(GPUConnectorInterface):  # type: ignore[misc]
        """Copies chunks between `kv` ([layers, kv, tokens, hidden] on CPU) and LMCache's
        `MemoryObj`s ([kv, layers, tokens, hidden], LMCache's KV_2LTD / KV_MLA_FMT)."""

        def __init__(self, kv: torch.Tensor) -> None:
            self.kv = kv

        def get_shape(self, num_tokens: int) -> torch.Size:
            layers, kv, _, hidden = self.kv.shape
            return torch.Size([kv, layers, num_tokens, hidden])

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            memory_obj.tensor.copy_(self.kv[:, :, start:end].permute(1, 0, 2, 3))

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
            self.kv[:, :, start:end].copy_(memory_obj.tensor.permute(1, 0, 2, 3))

        def batched_from_gpu(self, objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for o, s, e in zip(objs, starts, ends):
                self.from_gpu(o, s, e)

        def batched_to_gpu(self, objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
            for o, s, e in zip(objs, starts, ends):
                self.to_gpu(o, s, e)

    return CPUKVConnector


_engines = 0


@contextmanager
def engine(cfg: Any, md: Any, kv: torch.Tensor) -> Iterator[Any]:
    """A real `LMCacheEngine` (LMCache's builder, storage manager, `RemoteBackend` for plugin
    `hicache`) whose serving-engine KV is the CPU tensor `kv`; destroyed on exit."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    global _engines
    _engines += 1
    name = f"hicache-test-{_engines}"
    eng = LMCacheEngineBuilder.get_or_create(name, cfg, md, _connector_class()(kv),
                                             lambda t, r: None, lambda o, r: o)
    try:
        eng.post_init()
        yield eng
    finally:
        LMCacheEngineBuilder.destroy(name)


def remote_backend(eng: Any) -> Any:
    return eng.storage_manager.storage_backends[f"RemoteBackend-{PLUGIN}"]


def hicache_connector(eng: Any) -> Any:
    """Our `HiCacheConnector` inside the engine's `RemoteBackend` (LMCache wraps it)."""
    return remote_backend(eng).connection.getWrappedConnector()


def wait_puts(eng: Any, chunks: int) -> None:
    """LMCache stores to a remote backend asynchronously: wait until the connector has settled
    `chunks` chunks in all (stored, not stored, refused or skipped)."""
    conn = hicache_connector(eng)

    def settled() -> bool:
        st = conn.stats()
        return sum(st[k] for k in ("chunks_stored", "chunks_not_stored", "chunks_refused",
                                   "chunks_skipped_mla")) >= chunks

    wait_until(settled, timeout=20.0, interval=0.02, what="settled puts")


class ConnectorHarness:
    """A connector built the way LMCache's `RemoteBackend` builds one (`CreateConnector` ->
    `ConnectorManager` -> our adapter -> `InstrumentedRemoteConnector`), with a real
    `LocalCPUBackend` for its `MemoryObj`s and an event loop thread like LMCache's."""

    def __init__(self, url: str, md: Any | None = None, pool_bytes: int = 32 << 20,
                 config: Any | None = None, **extra: Any) -> None:
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        self.md = md if md is not None else metadata()
        self.config = config if config is not None else LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.05, remote_serde="naive",
            remote_storage_plugins=[PLUGIN], extra_config=settings(url, **extra))
        self.cpu = LocalCPUBackend(self.config, self.md, memory_allocator=TensorMemoryAllocator(
            torch.empty(pool_bytes, dtype=torch.uint8)))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.created: list[Any] = []

    def create(self, url: str = f"plugin://{PLUGIN}", md: Any | None = None) -> Any:
        from lmcache.v1.storage_backend.connector import CreateConnector

        conn = CreateConnector(url, self.loop, self.cpu, self.config, md or self.md,
                               plugin_name=PLUGIN if url.startswith("plugin://") else None)
        self.created.append(conn)
        return conn

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def chunk(self, tokens: int = CHUNK, seed: int = 0, md: Any | None = None) -> Any:
        """A `MemoryObj` of `tokens` tokens in LMCache's layout, random bits."""
        from lmcache.v1.memory_management import MemoryFormat

        md = md or self.md
        fmt = MemoryFormat.KV_MLA_FMT if md.use_mla else MemoryFormat.KV_2LTD
        obj = self.cpu.allocate(md.get_shapes(tokens), md.get_dtypes(), fmt)
        assert obj is not None
        g = torch.Generator().manual_seed(seed)
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=g).to(obj.tensor.dtype))
        return obj

    def key(self, chunk_hash: int, md: Any | None = None, model: str | None = None) -> Any:
        from lmcache.utils import CacheEngineKey

        md = md or self.md
        return CacheEngineKey(model or md.model_name, md.world_size, md.worker_id, chunk_hash,
                              md.kv_dtype)

    def put(self, conn: Any, keys: list[Any], objs: list[Any]) -> None:
        """What `RemoteBackend.batched_submit_put_task` does: a reference for the connector,
        which LMCache's wrapper drops once the put returns."""
        for o in objs:
            o.ref_count_up()
        self.run(conn.batched_put(keys, objs))

    def assert_holds(self, conn: Any, key: Any, want: torch.Tensor) -> None:
        """`conn.get(key)` hands back a chunk with exactly `want`'s bits (then releases it)."""
        got = self.run(conn.get(key))
        assert got is not None and same_bits(got.tensor, want)
        got.ref_count_down()

    def close(self) -> None:
        for conn in self.created:
            with contextlib.suppress(Exception):  # best effort at teardown
                self.run(conn.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
