"""`lmcache` backend and `lmcache-server-raw` (LMCache's own client for its server,
`LMCServerConnector`, with a CPU `LocalCPUBackend`), on one LMCache standalone server each."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.common import leading
from benchmarks.storage_targets import BackendClient, Client, ClientFactory, Target, bench_config
from tests.storage_backends.harness_lmcache import lmcache_server

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")


@contextmanager
def _start(tmp: Path) -> Iterator[ClientFactory]:
    tmp.mkdir(parents=True, exist_ok=True)
    with lmcache_server(tmp) as url:

        def make() -> Client:
            from storage_backends.lmcache_backend import LMCacheBackend

            return BackendClient(LMCacheBackend(bench_config({"url": url})))

        yield make


class RawLMCacheClient:
    """What an LMCache engine does against the server: `LMCServerConnector.put/get/exists` of
    `MemoryObj`s allocated by a `LocalCPUBackend` (one request at a time on one socket)."""

    def __init__(self, url: str, pool_bytes: int = 256 << 20) -> None:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        self.torch = torch
        self.key_cls = CacheEngineKey
        self.fmt = MemoryFormat.KV_2LTD
        cfg = LMCacheEngineConfig.from_defaults(chunk_size=256, local_cpu=False,
                                                max_local_cpu_size=1)
        # The metadata only has to describe *some* chunk: the connector sizes objects by the
        # shape each message carries.
        md = LMCacheMetadata(model_name="raw", world_size=1, local_world_size=1, worker_id=0,
                             local_worker_id=0, kv_dtype=torch.uint8,
                             kv_shape=(1, 2, 256, 1, 2048))
        self.cpu = LocalCPUBackend(cfg, md, memory_allocator=TensorMemoryAllocator(
            torch.empty(pool_bytes, dtype=torch.uint8)))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        host, port = url.removeprefix("lm://").rsplit(":", 1)
        self.conn = LMCServerConnector(host, int(port), self.loop, self.cpu)

    def _key(self, k: str) -> Any:
        return self.key_cls("raw", 1, 0, int(k, 16), self.torch.uint8)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def put(self, keys: list[str], values: list[memoryview]) -> None:
        for k, v in zip(keys, values):
            obj = self.cpu.allocate(self.torch.Size([len(v)]), self.torch.uint8, self.fmt)
            if obj is None:
                raise RuntimeError("LocalCPUBackend could not allocate")
            obj.tensor.view(-1).copy_(self.torch.frombuffer(v, dtype=self.torch.uint8))
            self._run(self.conn.put(self._key(k), obj))
            obj.ref_count_down()

    def get(self, keys: list[str], out: list[memoryview]) -> int:
        hits = 0
        for k, o in zip(keys, out):
            obj = self._run(self.conn.get(self._key(k)))
            if obj is None:
                continue
            data = obj.tensor.view(-1)
            if data.numel() == len(o):
                self.torch.frombuffer(o, dtype=self.torch.uint8).copy_(data)
                hits += 1
            obj.ref_count_down()
        return hits

    def exists(self, keys: list[str]) -> int:
        return leading(self.conn.exists_sync(self._key(k)) for k in keys)

    def close(self) -> None:
        self._run(self.conn.close())
        self.loop.call_soon_threadsafe(self.loop.stop)


@contextmanager
def _start_raw(tmp: Path) -> Iterator[ClientFactory]:
    tmp.mkdir(parents=True, exist_ok=True)
    with lmcache_server(tmp) as url:
        yield lambda: RawLMCacheClient(url)


TARGETS = [
    Target("lmcache", _start, marks=("lmcache",)),
    Target("lmcache-server-raw", _start_raw, baseline_of="lmcache", marks=("lmcache",)),
]
