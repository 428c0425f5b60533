"""`HiCacheServerStorage`: SGLang's `HiCacheStorage` over our `hicache-server`.

SGLang builds it with `--hicache-storage-backend dynamic` (its `StorageBackendFactory` calls
`HiCacheServerStorage(storage_config, kwargs)`), then hands it the host KV pool
(`register_mem_pool_host`). From then on its prefetch thread calls `batch_exists` and a get,
its backup thread a set: the zero-copy v1 pair (`batch_get_v1` / `batch_set_v1`, host slot
indices) when the extra config says `"interface_v1": 1`, else the v0 tensor calls (`batch_get`
/ `batch_set` of flat page tensors). Both paths store one checksummed page record per page.

Other host pools (SGLang's v2 interface: a speculative-decoding `draft` pool, SWA, indexer,
Mamba state...) come through `register_mem_host_pool_v2`, and their pages through
`batch_exists_v2` / `batch_get_v2` / `batch_set_v2` (`PoolTransfer`s: a pool name, its host
slots, SGLang's page keys). Each pool's pages are records in a namespace of their own (the
pool's name and geometry in the seed), through the same client.

Never an exception into SGLang's threads: a call that cannot work (server away, token refused,
a corrupt or foreign record, bad indices) answers a miss (`False`, `0`, `None`), and the failure
is counted (`stats()`) and logged once per kind. Misconfiguration is an error at start-up
instead: an unknown extra-config key, no model name, a server that refuses the token.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    PoolHitPolicy,
    PoolTransferResult,
)

from hicache_client.backend import StorageConfig
from hicache_client.errors import ConfigError
from hicache_client.remote.backend import HiCacheServerBackend
from hicache_client.sglang.pages import HostPages, tensor_bytes
from hicache_client.sglang.settings import (
    namespace_for,
    parse_settings,
    rank_view,
    storage_key,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
KV_POOL = "kv"  # the anchor pool's v2 name (the pool `register_mem_pool_host` got)


class HiCacheServerStorage(HiCacheStorage):
    """Pages of SGLang's host KV pool in a shared `hicache-server`, one record per page."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        self.settings = parse_settings(getattr(storage_config, "extra_config", None))
        self.ranks = rank_view(storage_config)
        if self.ranks.split_heads:
            raise ConfigError("hicache SGLang plugin: heterogeneous TP (tp_lcm_size, split "
                              "heads) is not supported")
        self.enable_metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self.registered_pools: dict[Any, Any] = {}
        self.pages: HostPages | None = None
        self.pools: dict[str, HostPages] = {}  # v2 name -> its pages ("kv": `pages`)
        self._shared: dict[str, bool] = {}  # v2 name -> pages the same on every TP rank
        self.backend: HiCacheServerBackend | None = None
        self.namespace = b""
        self._call_pages = 1  # pages per client call (`stage_bytes` of records)
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._counts = {"plugin_errors": 0, "skipped_sets": 0}
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []}
        if not self.settings.interface_v1:
            logger.info("hicache SGLang plugin: no \"interface_v1\": 1 in the extra config; "
                        "SGLang will use the v0 tensor calls (a copy per page more)")

    # -- set-up ------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Map the host pool's pages, derive the namespace, connect to the server. Raises at
        start-up on what cannot work (a pool without plain page regions, a refused token)."""
        super().register_mem_pool_host(mem_pool_host)
        pages = HostPages(mem_pool_host)
        ns = namespace_for(self.settings, self.ranks, dtype=pages.dtype,
                           page_size=pages.page_size, layout=pages.layout,
                           page_geometry=pages.geometry)
        pages.bind(ns)
        # No namespace in the client's config: it serves every pool's namespace, and each
        # pool's pages judge the namespace of the records read for them (`HostPages.accept`).
        backend = HiCacheServerBackend(StorageConfig(
            extra=self.settings.client, record_bytes=pages.record_bytes,
            tp_rank=self.ranks.tp_rank, tp_size=self.ranks.tp_size))
        old, self.backend = self.backend, backend
        if old is not None:
            old.close()
        self.pages, self.namespace = pages, ns
        self.pools = {KV_POOL: pages}
        self._shared = {KV_POOL: self.ranks.is_mla}
        self._call_pages = max(1, self.settings.stage_bytes // pages.record_bytes)
        logger.info("hicache SGLang plugin: %s, %s pages of %d bytes (%s), namespace %s, %s",
                    backend.url, pages.layout, pages.payload_bytes, pages.dtype, ns.hex()[:16],
                    "MLA, " + ("writer" if self.ranks.is_writer else "reader")
                    if self.ranks.is_mla else f"tp {self.ranks.tp_rank}/{self.ranks.tp_size}")

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A host pool of SGLang's v2 interface (the anchor KV pool again, or a side pool: a
        `draft` pool, SWA, indexer, Mamba...). Its pages get a namespace of their own: the
        pool's name and geometry, and the shard (the TP rank unless the pool's pages are the
        same on every rank: an MLA target's pools, except MHA-shaped ones and Mamba state).
        A pool whose pages are not plain regions of CPU tensors raises `ConfigError` (attach
        fails: a model must not run with a pool SGLang believes is stored)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if host_pool is self.mem_pool_host or name == KV_POOL:
            return  # the anchor, registered already
        try:
            pages = HostPages(host_pool)
        except Exception as e:  # noqa: BLE001 - reported as the attach error
            raise ConfigError(f"hicache SGLang plugin: host pool {name!r} "
                              f"({type(host_pool).__name__}) cannot be stored: {e}") from e
        mha = any(c.__name__ == "MHATokenToKVPoolHost" for c in type(host_pool).__mro__)
        shared = self.ranks.is_mla and not mha and name != "mamba"
        ranks = dataclasses.replace(self.ranks, is_mla=shared)
        pages.bind(namespace_for(self.settings, ranks, dtype=pages.dtype,
                                 page_size=pages.page_size, layout=pages.layout,
                                 page_geometry={**pages.geometry, "name": name}))
        self.pools[name], self._shared[name] = pages, shared
        logger.info("hicache SGLang plugin: host pool %r, %s pages of %d bytes, namespace %s%s",
                    name, pages.layout, pages.payload_bytes, pages.namespace.hex()[:16],
                    " (shared by every rank)" if shared else "")

    def close(self) -> None:
        backend, self.backend = self.backend, None
        if backend is not None:
            backend.close()

    # -- helpers -----------------------------------------------------------------------------

    def _ready(self) -> tuple[HostPages, HiCacheServerBackend]:
        if self.pages is None or self.backend is None:
            raise RuntimeError("no host pool registered (register_mem_pool_host)")
        return self.pages, self.backend

    def _guard(self, op: str, default: T, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - SGLang's threads must never see it
            with self._lock:
                self._counts["plugin_errors"] += 1
                first = op not in self._warned
                self._warned.add(op)
            if first:
                logger.error("hicache SGLang plugin: %s failed (answered as a miss): %s", op, e,
                             exc_info=not isinstance(e, ValueError | RuntimeError))
            else:
                logger.debug("hicache SGLang plugin: %s failed: %s", op, e)
            return default

    def _keys(self, keys: Sequence[str], pages: HostPages | None = None) -> list[str]:
        ns = pages.namespace if pages is not None else self.namespace
        return [storage_key(ns, k) for k in keys]

    def _pool(self, name: Any) -> HostPages:
        pages = self.pools.get(str(name))
        if pages is None:
            raise ValueError(f"host pool {str(name)!r} was never registered")
        return pages

    def _note(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        if not self.enable_metrics or pages <= 0:
            return
        with self._lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(nbytes / (1 << 30) / max(seconds, 1e-9))

    def _read(self, keys: Sequence[str], regions: Sequence[Sequence[memoryview]],
              pool: str = KV_POOL) -> list[bool]:
        """Read the records of `keys`, each payload straight into its page's `regions` (the
        header into this thread's header buffers), in client calls of at most `stage_bytes`.
        Stops after the call with the first miss: SGLang uses only the leading run of hits.

        A page answered False was never copied when it was absent, of another length, key,
        namespace or format (judged on the header first); its regions may hold bytes of a
        record that failed its checksum, or that moved while being copied, and SGLang does not
        use a slot answered False (see docs/sglang.md)."""
        backend = self._ready()[1]
        pages = self._pool(pool)
        t0 = time.perf_counter()
        skeys = self._keys(keys, pages)
        ok = [False] * len(keys)
        for start in range(0, len(keys), self._call_pages):
            part = range(start, min(len(keys), start + self._call_pages))
            heads = pages.heads(len(part))
            got = backend.batch_get_parts([skeys[i] for i in part],
                                          [[h, *regions[i]] for i, h in zip(part, heads)],
                                          accept=pages.accept)
            for i, hit in zip(part, got):
                ok[i] = hit
            if not all(got):
                break
        hits = sum(ok)
        self._note("prefetch", hits, hits * pages.payload_bytes, time.perf_counter() - t0)
        return ok

    def _write(self, keys: Sequence[str], regions: Sequence[Sequence[memoryview]],
               pool: str = KV_POOL) -> list[bool]:
        """Store each page's record: its header (checksummed over `regions` where they lie)
        in this thread's header buffers, its payload gathered by the client from `regions`
        straight into the server's store, in calls of at most `stage_bytes`. A rank that is
        not the writer (MLA, rank > 0) answers True without writing: the writer stores the
        same pages (and so for every pool whose pages are the same on every rank)."""
        if self._shared.get(pool, False) and not self.ranks.is_writer:
            with self._lock:
                self._counts["skipped_sets"] += len(keys)
            return [True] * len(keys)
        backend = self._ready()[1]
        pages = self._pool(pool)
        t0 = time.perf_counter()
        skeys = self._keys(keys, pages)
        ok: list[bool] = []
        for start in range(0, len(keys), self._call_pages):
            part = range(start, min(len(keys), start + self._call_pages))
            heads = pages.heads(len(part))
            for i, h in zip(part, heads):
                pages.seal(skeys[i], regions[i], h)
            ok += backend.batch_set_parts([skeys[i] for i in part],
                                          [[h, *regions[i]] for i, h in zip(part, heads)])
        stored = sum(ok)
        self._note("backup", stored, stored * pages.payload_bytes, time.perf_counter() - t0)
        return ok

    # -- v1: zero copy over the registered host pool -----------------------------------------

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Read pages straight into their host slots (`host_indices`: page_size slots per
        key). Per key, whether the slot now holds the page."""
        if not keys:
            return []

        def run() -> list[bool]:
            pages, _ = self._ready()
            return self._read(keys, pages.page_views(host_indices, len(keys)))

        return self._guard("batch_get_v1", [False] * len(keys), run)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Store the pages in host slots `host_indices`. Per key, whether it is stored."""
        if not keys:
            return []

        def run() -> list[bool]:
            pages, _ = self._ready()
            return self._write(keys, pages.page_views(host_indices, len(keys)))

        return self._guard("batch_set_v1", [False] * len(keys), run)

    # -- v0: flat page tensors ---------------------------------------------------------------

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Fill each target (a flat page tensor, SGLang's `get_dummy_flat_data_page()`; a new
        tensor when None) with its page. Per key, the tensor, or None on a miss."""
        n = len(keys)
        targets: list[Any] = [None] * n if target_locations is None else list(target_locations)

        def run() -> list[torch.Tensor | None]:
            pages, _ = self._ready()
            if len(targets) != n:
                raise ValueError(f"{len(targets)} target tensors for {n} keys")
            for i, t in enumerate(targets):
                if t is None:
                    targets[i] = torch.empty(pages.payload_bytes, dtype=torch.uint8).view(
                        self.mem_pool_host.dtype)
            views = [tensor_bytes(t) for t in targets]
            if any(len(v) != pages.payload_bytes for v in views):
                raise ValueError(f"a target is not one page ({pages.payload_bytes} bytes)")
            hit = self._read(keys, [[v] for v in views])
            return [t if h else None for t, h in zip(targets, hit)]

        return self._guard("batch_get", [None] * n, run)

    def get(self, key: str, target_location: Any = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat page tensors (`get_data_page(index)`). True when every page is stored."""
        if not keys:
            return True

        def run() -> bool:
            pages, _ = self._ready()
            if values is None or len(values) != len(keys):
                raise ValueError("batch_set needs one page tensor per key")
            return all(self._write(keys, [[tensor_bytes(v.contiguous())] for v in values]))

        return self._guard("batch_set", False, run)

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    # -- v2: every host pool (PoolTransfer) -------------------------------------------------

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None,
                        extra_info: Any = None) -> Any:
        """The usable prefix of `keys` over the KV pool and every pool of `pool_transfers`, as
        SGLang's `PoolTransferResult`: per pool its boundary, and every prefix length at which
        all pools can be restored (`all_pages`: each page up to it; `trailing_pages`: the
        window of `len(transfer.keys)` pages ending there). A `block_groups` pool gives no
        verdict (it never gates the KV hit). A failure answers an empty prefix."""

        def run() -> Any:
            backend = self._ready()[1]
            kv = self.batch_exists(keys) if keys else 0
            hits: dict[Any, int] = {KV_POOL: kv} if kv else {}
            restorable = list(range(1, kv + 1))
            for t in pool_transfers or []:
                if not restorable:
                    break
                if t.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
                    continue
                skeys = self._keys(keys[:kv], self._pool(t.name))
                if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                    ok = set(range(1, backend.batch_exists(skeys) + 1))
                else:  # TRAILING_PAGES: a window ending at each prefix length
                    have = [backend.batch_exists([k]) == 1 for k in skeys]
                    window = max(1, len(t.keys) if t.keys else 1)
                    ok = {n for n in range(1, kv + 1) if all(have[max(0, n - window):n])}
                if ok:
                    hits[t.name] = max(ok)
                restorable = [n for n in restorable if n in ok]
            return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

        return self._guard("batch_exists_v2", PoolTransferResult(0, {}, []), run)

    def _v2(self, op: str, transfers: Any, write: bool) -> dict[Any, list[bool]]:
        out: dict[Any, list[bool]] = {}
        for t in transfers or []:
            keys = list(t.keys or [])

            def run(t: Any = t, keys: list[str] = keys) -> list[bool]:
                pages = self._pool(t.name)
                if t.host_indices is None:
                    raise ValueError(f"pool {str(t.name)!r}: a transfer without host slots")
                views = pages.page_views(t.host_indices, len(keys))
                io = self._write if write else self._read
                return io(keys, views, str(t.name))

            out[t.name] = self._guard(op, [False] * len(keys), run) if keys else []
        return out

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Read each transfer's pages (`keys`) straight into its pool's host slots
        (`host_indices`). Per pool name, per key whether the slot now holds the page (a pool
        stops at its first miss, as the v1 get)."""
        return self._v2("batch_get_v2", transfers, write=False)

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Store each transfer's pages from its pool's host slots. Per pool name, per key
        whether it is stored."""
        return self._v2("batch_set_v2", transfers, write=True)

    # -- presence, administration, counters --------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many keys, from the first, the server holds."""
        if not keys:
            return 0
        return self._guard("batch_exists", 0,
                           lambda: self._ready()[1].batch_exists(self._keys(keys)))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def clear(self) -> bool:
        """Delete this rank's pages from the server, of every host pool, and no others (the
        server clears by namespace: other models, ranks and deployments keep theirs). Pools
        shared by every rank (MLA) are cleared by the writer rank. True when done."""

        def run() -> bool:
            backend = self._ready()[1]
            for name, pages in self.pools.items():
                if self.ranks.is_writer or not self._shared[name]:
                    backend.clear_namespace(pages.namespace)
            return True

        return self._guard("clear", False, run)

    def stats(self) -> dict[str, int]:
        """This rank's counters: the client's (`BackendStats`: pages asked and hit, bytes,
        `errors`, `corrupt_pages`...) plus `plugin_errors` (calls answered as a miss for a
        reason of the plugin's: bad indices, no pool registered) and `skipped_sets` (pages a
        non-writer rank was asked to store)."""
        out = self.backend.stats().as_dict() if self.backend is not None else {}
        with self._lock:
            out.update(self._counts)
        return out

    def get_stats(self) -> Any:
        """SGLang's storage metrics (pages and GB/s per prefetch and backup batch) since the
        last call, as its `StorageMetrics` (None when metrics are off)."""
        if not self.enable_metrics:
            return None
        with self._lock:
            snap = {k: list(v) for k, v in self._metrics.items()}
            for v in self._metrics.values():
                v.clear()
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:  # releases before 0.5.15
            from sglang.srt.metrics.collector import StorageMetrics
        m = StorageMetrics()
        for k, v in snap.items():
            getattr(m, k).extend(v)
        return m
