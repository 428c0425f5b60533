"""`HiCacheConnector`: an LMCache `RemoteConnector` that keeps LMCache's chunks in our
`hicache-server`, one checksummed page record per chunk (see `records` for the format).

LMCache calls a remote connector from its event loop (the `async` methods, through
`asyncio.run_coroutine_threadsafe`) and from its worker threads (`exists_sync`,
`batched_contains`, `remove_sync`). Every async method here runs its round trip on a worker
thread of the loop's default executor (`asyncio.to_thread`), so puts and gets overlap and the
event loop is never blocked by the network; the client underneath keeps a pool of connections
(same-host shared memory by default, see docs/hicache-server.md).

Contract towards LMCache (docs/lmcache.md):

- Nothing raises into LMCache after construction. A dead or slow server, a refused token, a
  corrupt record or a record of another namespace is a miss (`None`, `False`, `0`), and is
  counted in `stats()` (`errors`, `corrupt_pages`, `foreign_records`...).
- A chunk is never handed back unless its record passed every check: XXH3 checksum, key digest,
  namespace seed, dtype, shape, token count.
- MLA (`metadata.use_mla`): only worker 0 writes; every worker reads worker 0's chunks.
- `put`/`batched_put` do not release the `MemoryObj`s: LMCache's `InstrumentedRemoteConnector`
  does once they return. `get`/`batched_get` return objects allocated from LMCache's
  `LocalCPUBackend`, owned by the caller.
- Records move as parts (`batch_set_parts` / `batch_get_parts`): our header buffer, then the
  `MemoryObj`'s own bytes; on the server's host one copy each way, between the server's
  shared-memory store and the `MemoryObj`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from hicache_client.backend import StorageConfig, ThreadBuffers
from hicache_client.codec import HEADER_BYTES, RecordHeader
from hicache_client.errors import ConfigError, StorageError, StorageUnavailable
from hicache_client.lmcache.client import ConnectorBackend
from hicache_client.lmcache.records import (
    ChunkLayout,
    judge,
    namespace_seed,
    payload_parts,
    seal,
    storage_key,
)
from hicache_client.lmcache.settings import Settings, resolve

logger = logging.getLogger(__name__)

T = TypeVar("T")
_SEED_CACHE = 4096  # namespaces remembered (one per model x rank x dtype x tags seen)


@dataclass
class ConnectorStats:
    """Counters of one connector, in chunks unless named otherwise."""

    chunks_put: int = 0  # chunks LMCache asked to store
    chunks_stored: int = 0  # of those, stored on the server
    chunks_not_stored: int = 0  # refused by the server or lost with it (see `errors`)
    chunks_skipped_mla: int = 0  # MLA: not written because this worker is not worker 0
    chunks_refused: int = 0  # objects that are not a chunk of this engine's layout
    chunks_asked: int = 0  # chunks LMCache asked to read
    chunks_hit: int = 0  # of those, handed back
    foreign_records: int = 0  # records under our key with another namespace or format (dropped)
    alloc_failures: int = 0  # chunks not read: LMCache had no CPU memory to hold them
    failed_calls: int = 0  # calls that failed outside the client (a bug; logged) -> a miss


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


class HiCacheConnector(RemoteConnector):
    """LMCache remote connector for `hicache://host:port` (or plugin `hicache`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any,
                 config: Any = None, *, url: str | None = None, metadata: Any = None,
                 plugin_name: str | None = None) -> None:
        config = config if config is not None else getattr(local_cpu_backend, "config", None)
        if metadata is None:
            metadata = getattr(local_cpu_backend, "metadata", None)
        if config is None or metadata is None:
            raise ConfigError("hicache connector needs LMCache's engine config and metadata")
        if getattr(config, "use_layerwise", False):
            raise ConfigError("hicache connector: use_layerwise is not supported")
        if getattr(config, "remote_serde", "naive") not in (None, "naive"):
            raise ConfigError(f"hicache connector: remote_serde {config.remote_serde!r} is not "
                              "supported; use 'naive' (records are checksummed as they are)")
        super().__init__(config, metadata)
        self.settings: Settings = resolve(config.extra_config, url, plugin_name,
                                          getattr(config, "remote_url", None))
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.layout = ChunkLayout(
            fmt=self.meta_fmt.name,
            shapes=tuple(tuple(int(d) for d in s) for s in self.meta_shapes),
            dtypes=tuple(_dtype_name(d) for d in self.meta_dtypes),
            itemsizes=tuple(int(d.itemsize) for d in self.meta_dtypes),
            chunk_tokens=int(metadata.chunk_size),
            token_dim=int(self.meta_fmt.token_dim()),
            use_mla=bool(metadata.use_mla),
        )
        self.worker_id = int(metadata.worker_id)
        # MLA: the KV is the same on every rank; one writer is enough.
        self.writer = not (self.layout.use_mla and self.worker_id != 0)
        self._stats = ConnectorStats()
        self._lock = threading.Lock()
        self._seeds: dict[tuple[Any, ...], bytes] = {}
        self._written: OrderedDict[str, str] = OrderedDict()  # LMCache key -> server key
        self._heads = ThreadBuffers()
        self._warned: set[str] = set()
        self.backend = ConnectorBackend(StorageConfig(extra=dict(self.settings.backend_extra)))
        logger.info("hicache connector: %s, %s chunks of %d tokens (%d B records), worker %d%s",
                    self.settings.url, self.layout.fmt, self.layout.chunk_tokens,
                    self.layout.record_bytes, self.worker_id,
                    "" if self.writer else " (MLA reader only)")

    # -- keys ----------------------------------------------------------------------------------

    def namespace(self, key: CacheEngineKey) -> bytes:
        """The namespace seed of `key`'s model, rank, dtype and tags in this layout."""
        ident = (key.model_name, key.world_size, key.worker_id, key.dtype, key.tags)
        seed = self._seeds.get(ident)
        if seed is None:
            seed = namespace_seed(self.layout, key.model_name, key.world_size, key.worker_id,
                                  _dtype_name(key.dtype), key.tags)
            with self._lock:
                if len(self._seeds) >= _SEED_CACHE:
                    self._seeds.clear()
                self._seeds[ident] = seed
        return seed

    def storage_key(self, key: CacheEngineKey) -> str:
        """The server key `key`'s record is stored under."""
        return storage_key(self.namespace(key), key.chunk_hash)

    # -- helpers -------------------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)

    def _warn_once(self, what: str, msg: str, *args: object, exc: bool = False) -> None:
        if what in self._warned:
            logger.debug(msg, *args)
            return
        self._warned.add(what)
        logger.error(msg, *args, exc_info=exc)

    def _guard(self, op: str, default: T, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, or `default` (counted, logged once) if it raises anything."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - nothing may raise into LMCache
            self._count(failed_calls=1)
            self._warn_once(f"call:{op}", "hicache connector: %s failed: %s", op, e, exc=True)
            return default

    def _tokens(self, obj: MemoryObj) -> int:
        """Tokens in `obj` when it is a chunk of this engine's layout, else -1."""
        if obj.get_memory_format() != self.meta_fmt:
            return -1
        shapes = [tuple(s) for s in obj.get_shapes()]
        dtypes = [_dtype_name(d) for d in obj.get_dtypes()]
        tokens = self.layout.tokens_of(shapes, dtypes)
        if tokens > 0 and obj.get_size() != tokens * self.layout.token_bytes:
            return -1
        return tokens

    def _allocate(self) -> MemoryObj | None:
        """A full-chunk object from LMCache's CPU pool, or None (never waits for room)."""
        try:
            return self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes,
                                                   self.meta_fmt, busy_loop=False)
        except Exception as e:  # noqa: BLE001 - e.g. the scheduler role has no pool
            self._warn_once("alloc", "hicache connector: cannot allocate a chunk: %s", e)
            return None

    # -- the work (worker threads) -------------------------------------------------------------

    def _put_many(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj]) -> None:
        self._count(chunks_put=len(keys))
        if not self.writer:
            self._count(chunks_skipped_mla=len(keys))
            return
        plan: list[tuple[CacheEngineKey, MemoryObj, int]] = []
        for key, obj in zip(keys, objs):
            tokens = self._tokens(obj)
            if tokens < 0:
                self._count(chunks_refused=1)
                self._warn_once("refused", "hicache connector: not storing %s: shapes %s "
                                "dtypes %s format %s are not this engine's chunks", key,
                                obj.get_shapes(), obj.get_dtypes(), obj.get_memory_format())
                continue
            plan.append((key, obj, tokens))
        for lo in range(0, len(plan), self.settings.batch_chunks):
            self._put_part(plan[lo : lo + self.settings.batch_chunks])

    def _put_part(self, part: Sequence[tuple[CacheEngineKey, MemoryObj, int]]) -> None:
        """One `batch_set_parts`: each record is our header, then the chunk where it lies."""
        heads = self._heads.take([HEADER_BYTES] * len(part))
        skeys: list[str] = []
        parts: list[list[memoryview]] = []
        for (key, obj, tokens), head in zip(part, heads):
            seed = self.namespace(key)
            skey = storage_key(seed, key.chunk_hash)
            payload = payload_parts(self.layout, tokens, memoryview(obj.byte_array).cast("B"))
            seal(self.layout, seed, skey, tokens, payload, head)
            skeys.append(skey)
            parts.append([head, *payload])
        ok = self.backend.batch_set_parts(skeys, parts)
        stored = sum(ok)
        self._count(chunks_stored=stored, chunks_not_stored=len(ok) - stored)
        if self.settings.list_limit:
            with self._lock:
                for (key, _, _), skey, good in zip(part, skeys, ok):
                    if good:
                        self._written[key.to_string()] = skey
                        self._written.move_to_end(key.to_string())
                while len(self._written) > self.settings.list_limit:
                    self._written.popitem(last=False)

    def _get_many(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        self._count(chunks_asked=len(keys))
        res: list[MemoryObj | None] = [None] * len(keys)
        try:
            for lo in range(0, len(keys), self.settings.batch_chunks):
                self._get_part(keys[lo : lo + self.settings.batch_chunks], res, lo)
        except BaseException:
            for obj in res:  # hand nothing half-done back; free what was allocated
                if obj is not None:
                    obj.ref_count_down()
            raise
        self._count(chunks_hit=sum(o is not None for o in res))
        return res

    def _get_part(self, part: Sequence[CacheEngineKey], res: list[MemoryObj | None],
                  lo: int) -> None:
        """One `batch_get_parts` straight into LMCache `MemoryObj`s: each record lands as our
        header buffer, then the object's bytes. A record that is not a chunk of ours (`judge`)
        is never copied into the object, and is counted, dropped and deleted by the client."""
        spaces = [self.namespace(k) for k in part]
        skeys = [storage_key(seed, k.chunk_hash) for seed, k in zip(spaces, part)]
        seeds = dict(zip(skeys, spaces))
        objs = [self._allocate() for _ in part]
        idx = [i for i, o in enumerate(objs) if o is not None]
        self._count(alloc_failures=len(part) - len(idx))
        tokens: dict[str, int] = {}
        foreign: dict[str, str] = {}

        def accept(skey: str, header: RecordHeader) -> str | None:
            problem = judge(self.layout, seeds[skey], header)
            if problem is None:
                tokens[skey] = int(header.token_count)
            else:
                foreign[skey] = problem
            return problem

        try:
            heads = self._heads.take([HEADER_BYTES] * len(idx))
            parts = [[head, memoryview(objs[i].byte_array).cast("B")]  # type: ignore[union-attr]
                     for head, i in zip(heads, idx)]
            ok = self.backend.batch_get_parts([skeys[i] for i in idx], parts, accept=accept)
            for i, hit in zip(idx, ok):
                obj = objs[i]
                assert obj is not None
                objs[i] = None
                if not hit:
                    obj.ref_count_down()
                    continue
                n = tokens[skeys[i]] * self.layout.token_bytes
                if n < self.layout.payload_bytes:
                    obj = self._shrink(obj, n)
                res[lo + i] = obj
        finally:
            for obj in objs:  # allocated, not handed on (an exception above)
                if obj is not None:
                    obj.ref_count_down()
        if foreign:
            self._count(foreign_records=len(foreign))
            self._warn_once("foreign", "hicache connector: dropped %d record(s) that are not "
                            "chunks of this engine, e.g. %s: %s", len(foreign),
                            next(iter(foreign))[:16], next(iter(foreign.values())))

    def _shrink(self, obj: MemoryObj, nbytes: int) -> MemoryObj:
        """A partial chunk: LMCache's own `reshape_partial_chunk` (frees `obj` if it fails)."""
        try:
            return self.reshape_partial_chunk(obj, nbytes)
        except BaseException:
            obj.ref_count_down()
            raise

    def _exists_run(self, keys: Sequence[CacheEngineKey]) -> int:
        if not keys:
            return 0
        return self.backend.batch_exists([self.storage_key(k) for k in keys])

    def _list(self) -> list[str]:
        with self._lock:
            items = list(self._written.items())
        names = [n for n, _ in items]
        skeys = [s for _, s in items]
        present: list[str] = []
        i = 0
        while i < len(skeys):
            errors = self.backend.stats().errors
            run = self.backend.batch_exists(skeys[i:])
            present.extend(names[i : i + run])
            if self.backend.stats().errors != errors:
                break  # the server is away: what it holds is unknown
            i += run + 1
        return present

    def _remove(self, key: CacheEngineKey) -> bool:
        try:
            self.backend.delete([self.storage_key(key)])
        except StorageError as e:
            self._warn_once("remove", "hicache connector: remove failed: %s", e)
            return False
        with self._lock:
            self._written.pop(key.to_string(), None)
        return True

    def _ping(self) -> int:
        try:
            self.backend.ping()
        except StorageUnavailable:
            return 1
        except StorageError:
            return 2
        return 0

    # -- RemoteConnector -----------------------------------------------------------------------

    async def exists(self, key: CacheEngineKey) -> bool:
        return await asyncio.to_thread(self.exists_sync, key)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._guard("exists", 0, self._exists_run, [key]) == 1

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        keys = list(keys)
        return await asyncio.to_thread(self._guard, "get", [None] * len(keys),
                                       self._get_many, keys)

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        await asyncio.to_thread(self._guard, "put", None, self._put_many, list(keys),
                                list(memory_objs))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        return self._guard("contains", 0, self._exists_run, list(keys))

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey],
                                     pin: bool = False) -> int:
        return await asyncio.to_thread(self.batched_contains, list(keys))

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str,
                                       keys: list[CacheEngineKey]) -> list[MemoryObj]:
        """The leading run of hits (LMCache's contract); later hits are released."""
        got = await self.batched_get(keys)
        run: list[MemoryObj] = []
        for obj in got:
            if obj is None:
                break
            run.append(obj)
        for obj in got[len(run):]:
            if obj is not None:
                obj.ref_count_down()
        return run

    async def list(self) -> list[str]:
        """The LMCache keys (`CacheEngineKey.to_string()`) this connector stored that the server
        still holds, of the last `list_limit` stored: the server has no listing of its own."""
        return await asyncio.to_thread(self._guard, "list", [], self._list)

    def remove_sync(self, key: CacheEngineKey) -> bool:
        return self._guard("remove", False, self._remove, key)

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0: the server answers; 1: unreachable; 2: it refuses us (token)."""
        return await asyncio.to_thread(self._ping)

    async def close(self) -> None:
        await asyncio.to_thread(self.close_sync)

    def close_sync(self) -> None:
        self.backend.close()

    # -- observability -------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """This connector's counters (`ConnectorStats`) and its client's (`BackendStats`:
        `errors`, `corrupt_pages`, `set_failures`...), in one flat dict."""
        with self._lock:
            mine = asdict(self._stats)
        return {**self.backend.stats().as_dict(), **mine}

    def __repr__(self) -> str:
        return f"<HiCacheConnector {self.settings.url} worker {self.worker_id}>"
