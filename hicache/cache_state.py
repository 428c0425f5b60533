"""`CacheState`: the state, construction and lifecycle of a `HiRadixCache`.

The pools and allocators, the tree, the page-digest chain, the event emitter, the eviction
candidates, the counters, the transfer controller and the parts that work on them (`Prefetcher`,
`Acks`); attaching and detaching L3, reset, close, and what the cache reports (`stats`, `usage`,
`check_integrity`). `hicache.hiradix.HiRadixCache` adds the tree operations on top.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from hicache.acks import Acks
from hicache.config import HiCacheConfig
from hicache.controller import TransferController
from hicache.emit import Emitter
from hicache.errors import ConfigError
from hicache.events import EventSink
from hicache.eviction import Candidates, device_candidate, host_candidate, make_policy
from hicache.integrity import check_integrity, state_digest, usage
from hicache.keys import KeyChain, namespace_seed
from hicache.pools import DeviceKVPool, HostKVPool, PageAllocator, dtype_name
from hicache.prefetch import Prefetcher
from hicache.radix import RadixTree, TreeNode
from hicache.sim_storage import SimStorage
from hicache.stats import CacheStats
from hicache.storage import BackendStats, PageCodec, StorageBackend
from hicache.sync import SOLO, RankSync
from hicache.wiring import host_pages_for, make_backend, make_codec, make_controller

logger = logging.getLogger("hicache.hiradix")


class CacheState:
    def __init__(
        self,
        config: HiCacheConfig,
        *,
        device_pool: DeviceKVPool | None = None,
        host_pool: HostKVPool | None = None,
        storage: StorageBackend | None = None,
        namespace: bytes | None = None,
        num_device_pages: int | None = None,
        num_host_pages: int | None = None,
        sim_storage: SimStorage | None = None,
        event_sink: EventSink | None = None,
        sync: RankSync = SOLO,
        shared_storage: bool = False,
    ) -> None:
        """`sync`: agreement with the other tensor-parallel ranks (`hicache.sync`).
        `shared_storage`: every rank holds the same pages under the same keys (MLA's one
        latent): only the rank `sync.writes_shared` names writes L3; every rank reads it."""
        self.config = config
        self.sync = sync
        self.writes_storage = sync.writes_shared or not shared_storage
        self.page_size = ps = config.page_size
        self.simulated = config.simulated
        self.device_pool = device_pool
        self.host_pool: HostKVPool | None = None
        self.storage: StorageBackend | None = None
        self.sim_storage: SimStorage | None = None
        self.codec: PageCodec | None = None
        if self.simulated:
            if device_pool is not None or host_pool is not None or storage is not None:
                raise ConfigError("simulated mode takes page counts, not pools or backends")
            if num_device_pages is None:
                raise ConfigError("simulated mode needs num_device_pages")
            if num_host_pages is None:
                num_host_pages = int(num_device_pages * config.host_ratio)
            self.device_alloc = PageAllocator(num_device_pages)
            self.host_alloc = PageAllocator(num_host_pages)
            self.sim_storage = sim_storage
            if sim_storage is not None and num_host_pages == 0:
                raise ConfigError("a storage tier needs a host tier to stage pages")
            self.namespace = namespace or namespace_seed(
                model_fingerprint="simulated", dtype="none", page_size=ps, layout="none"
            )
        else:
            if device_pool is None:
                raise ConfigError("HiRadixCache needs a device_pool (or simulated=True)")
            if device_pool.page_size != ps:
                raise ConfigError(
                    f"device pool page size {device_pool.page_size} != config page size {ps}"
                )
            self.device_alloc = device_pool.allocator
            if host_pool is None and num_host_pages != 0:
                host_pool = HostKVPool.like(
                    device_pool,
                    num_host_pages or host_pages_for(config, device_pool),
                    layout=config.mem_layout,
                    io_backend=config.io_backend,
                )
            self.host_pool = host_pool
            self.host_alloc = host_pool.allocator if host_pool else PageAllocator(0)
            self.namespace = namespace or namespace_seed(
                model_fingerprint="anonymous",
                dtype=dtype_name(device_pool.dtype),
                page_size=ps,
                layout=config.mem_layout,
            )
            self.storage = storage
            if self.storage is None and config.storage_backend:
                self.storage = self._make_backend(config.storage_backend, config.storage_extra_config)
            if self.storage is not None and self.host_pool is None:
                raise ConfigError("a storage backend needs a host tier to stage pages")
        if config.host_memory_mode == "buffer_only" and (
            self.storage is None and self.sim_storage is None or self.host_alloc.num_pages == 0
        ):
            raise ConfigError("host_memory_mode buffer_only needs a host tier and a storage tier")
        if len(self.namespace) != 32:
            raise ConfigError("namespace must be a 32-byte seed (hicache.keys.namespace_seed)")
        self.tree = RadixTree(ps)
        self.chain = KeyChain(self.namespace, ps)
        self.events = Emitter(self.chain, ps)
        self.events.sink = event_sink
        self.policy = make_policy(config.eviction_policy, config.eviction_config)
        self.device_candidates = Candidates(self.policy, device_candidate)
        self.host_candidates = Candidates(self.policy, host_candidate)
        self.counters = CacheStats()
        self.host_inflight: dict[int, list[int]] = {}
        self._corrupt_before = 0  # corrupt pages counted by backends detached since
        self.controller = self._make_controller()
        self.prefetcher = Prefetcher(self)
        self.acks = Acks(self, self.prefetcher)
        logger.info(
            "HiRadixCache: page_size=%d device_pages=%d host_pages=%d write_policy=%s "
            "eviction=%s storage=%s%s",
            ps,
            self.device_alloc.num_pages,
            self.host_alloc.num_pages,
            config.write_policy,
            config.eviction_policy,
            self._storage_name(),
            " (simulated)" if self.simulated else "",
        )

    def _make_backend(self, name: str, extra: object) -> StorageBackend:
        assert self.host_pool is not None
        self.codec = make_codec(self.host_pool, self.namespace, self.page_size)
        return make_backend(name, extra, self.namespace, self.codec, self.sync)

    def _make_controller(self) -> TransferController:
        if self.storage is not None and self.codec is None:
            assert self.host_pool is not None
            self.codec = make_codec(self.host_pool, self.namespace, self.page_size)
        return make_controller(
            self.config, device_pool=self.device_pool, host_pool=self.host_pool,
            storage=self.storage, codec=self.codec, sim_storage=self.sim_storage,
            sync=self.sync, writes_storage=self.writes_storage,
        )

    def _storage_name(self) -> str:
        if self.simulated:
            return "simulated" if self.sim_storage is not None else "none"
        return self.storage.name if self.storage is not None else "none"

    @property
    def has_storage(self) -> bool:
        return self.controller.has_storage

    @property
    def host_enabled(self) -> bool:
        return self.host_alloc.num_pages > 0

    def set_event_sink(self, sink: EventSink | None) -> None:
        """Report cache events (`hicache.events`) to `sink` from now on (None: stop)."""
        self.events.sink = sink

    def storage_keys(self, node: TreeNode) -> list[str]:
        """The L3 keys of `node`'s pages."""
        return self.chain.storage_keys(node)

    # -- tier changes (every one reported to the event sink) ---------------------------------

    def set_device(self, node: TreeNode, pages: list[int] | None) -> None:
        if pages is None and node.value is not None:
            self.events.removed(node, "device")
        self.tree.set_value(node, pages)
        if pages is not None:
            self.events.stored(node, "device")

    def set_host(self, node: TreeNode, pages: list[int] | None) -> None:
        if pages is None and node.host_value is not None:
            self.events.removed(node, "host")
        node.host_value = pages
        if pages is not None:
            self.events.stored(node, "host")

    def lock(self, node: TreeNode) -> None:
        """Pin `node` and its ancestors on the device (they cannot be evicted until unlocked)."""
        self.tree.inc_lock(node)

    def unlock(self, node: TreeNode) -> None:
        self.unpinned(self.tree.dec_lock(node))

    release = unlock

    def unpinned(self, nodes: list[TreeNode]) -> None:
        for x in nodes:
            self.device_candidates.push(x)
            self.host_candidates.push(x)

    def free_device(self, pages: Sequence[int]) -> None:
        """Give back device pages the caller did not hand to the tree."""
        self.device_alloc.free(pages)

    # -- acks (hicache.acks) -----------------------------------------------------------------

    def poll(self) -> int:
        """Apply every completed background transfer; return how many were applied."""
        return self.acks.poll()

    def _after(self) -> None:
        if self.controller.synchronous:
            self.acks.poll()

    def wait_progress(self, timeout: float) -> bool:
        """Block up to `timeout` s until a background transfer completes; True when an ack is
        waiting to be applied."""
        return self.controller.wait_progress(timeout)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A forward computed `tokens` prompt tokens in `seconds` (the recompute side of the
        load-vs-recompute plan)."""
        self.controller.observe_prefill(tokens, seconds)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every background transfer (and the ones their acks start) to finish."""
        self.acks.flush(timeout)

    # -- whole-cache operations --------------------------------------------------------------

    def reset(self) -> None:
        """Drop every cached page (L1 and L2; L3 is untouched). No node may be locked."""
        self.prefetcher.cancel_all()
        self.flush()
        for r in self.tree.roots.values():
            for c in r.children.values():
                if c.lock_ref or c.host_ref:
                    raise RuntimeError("reset() while requests hold cached prefixes")
        for x in self.tree.nodes():
            if x.value is not None:
                self.device_alloc.free(x.value)
            if x.host_value is not None:
                self.host_alloc.free(x.host_value)
        self.tree.clear()
        self.device_candidates.clear()
        self.host_candidates.clear()
        self.events.cleared("device")
        self.events.cleared("host")

    def attach_storage(self, name: str, extra: dict[str, object] | None = None) -> None:
        """Attach (or replace) the L3 backend. Call while idle."""
        if self.simulated:
            raise ConfigError("simulated caches take a SimStorage at construction")
        if self.host_pool is None:
            raise ConfigError("a storage backend needs a host tier to stage pages")
        backend = self._make_backend(name, extra or {})
        self.detach_storage()
        self.storage = backend
        self.controller.close()
        self.controller = self._make_controller()

    def detach_storage(self) -> None:
        """Detach the L3 backend (pages stay in it). Call while idle."""
        if self.storage is None:
            return
        self.prefetcher.cancel_all()
        self.flush()
        self.controller.close()
        self._corrupt_before += self.storage.stats().corrupt_pages
        self.storage.close()
        self.storage = None
        self.controller = self._make_controller()

    def clear_storage(self) -> None:
        """Delete this cache's pages from the attached L3 backend (`StorageBackend.clear`: its
        namespace where the backend can tell namespaces apart, else every page; see
        docs/storage.md). Waits for transfers in flight first. Call while idle."""
        if self.storage is None:
            raise ConfigError("no storage backend is attached")
        self.prefetcher.cancel_all()
        self.flush()
        self.storage.clear()
        self.events.cleared("storage")

    def close(self) -> None:
        try:
            self.flush(timeout=60)
        except TimeoutError:
            logger.warning("closing with transfers still running")
        self.controller.close()
        if self.storage is not None:
            self.storage.close()

    # -- observation (hicache.integrity) -----------------------------------------------------

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the counters. `corrupt_pages` is what the L3 backends dropped as
        corrupt (their `BackendStats.corrupt_pages`): one count, not a second one."""
        s = self.counters.copy()
        s.storage_errors = self.controller.storage_errors
        s.corrupt_pages = self._corrupt_before + (
            self.storage.stats().corrupt_pages if self.storage is not None else 0
        )
        return s

    def storage_stats(self) -> BackendStats | None:
        return self.storage.stats() if self.storage is not None else None

    def evictable_device_tokens(self) -> int:
        """Device tokens held by the tree and not locked (O(1)): what eviction could free."""
        return (self.tree.device_pages - self.tree.locked_device_pages) * self.page_size

    def usage(self) -> dict[str, int]:
        """Pool and tree occupancy, in pages and tokens."""
        return usage(self, len(self.prefetcher))

    def state_digest(self) -> list[int]:
        """Numbers that equal ranks' caches share (`hicache.integrity.state_digest`)."""
        return state_digest(self, len(self.prefetcher))

    def check_integrity(self, outside_device_pages: int | None = None) -> None:
        """Raise AssertionError, with the numbers, when any invariant is broken (the list is in
        `hicache.integrity`)."""
        check_integrity(self, outside_device_pages)
        for op in self.prefetcher.pending.values():
            assert not op.anchor.removed, "prefetch anchor left the tree"

    def alloc_host(self, n: int) -> list[int] | None:
        """`n` host pages, evicting host copies as needed; None when impossible."""
        raise NotImplementedError
