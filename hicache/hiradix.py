"""`HiRadixCache`: the tiered KV cache (device L1, host L2, storage L3) over a radix tree.

Tier states of a node: device only, device + host, host only. A node on neither leaves the tree.
L3 presence is not mirrored in the tree; it is asked of the backend when a request arrives.

This module holds the class whole: its state, construction and lifecycle (L3 attach/detach/clear,
reset, close, stats, checks) and the tree operations: match, acquire (with load-back), insert
(with the write policies) and evict. The parts with state of their own are objects it owns: the
prefetch state machine in `hicache.prefetch`, ack
application in `hicache.acks`, the buffer_only host mode in `hicache.staging`, occupancy and
invariant checks in `hicache.integrity` (which lists the invariants), L3 admission and soft pins
in `hicache.retention`, page digests in
`hicache_client.keys`, eviction candidates in `hicache.eviction`, cache events in `hicache.emit`, and
construction helpers in `hicache.wiring`.

Only one thread (the owner: the engine's scheduler) calls into this object. Background transfers
run in `TransferController`; their results are applied in `poll()`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from hicache.acks import Acks
from hicache.attribution import EvictedSketch, add_into, attribute, complete, left_cache
from hicache.config import HiCacheConfig
from hicache.controller import TransferController, WriteOp
from hicache.emit import Emitter
from hicache.events import EventSink
from hicache.eviction import Candidates, device_candidate, host_candidate, make_policy
from hicache.integrity import check_integrity, state_digest, usage
from hicache.keychain import KeyChain
from hicache.pools import DeviceKVPool, HostKVPool, PageAllocator, dtype_name
from hicache.prefetch import Prefetcher
from hicache.prefix_cache import Acquired, InsertResult, MatchResult
from hicache.radix import RadixTree, Tokens, TreeNode, common_pages
from hicache.retention import Keeper
from hicache.sim_storage import SimStorage
from hicache.staging import trim
from hicache.stats import CacheStats
from hicache.sync import SOLO, RankSync
from hicache.transfer import LayerDoneCounter
from hicache.wiring import host_pages_for, make_backend, make_codec, make_controller
from hicache_client.backend import BackendStats, StorageBackend
from hicache_client.codec import PageCodec
from hicache_client.errors import ConfigError
from hicache_client.keys import namespace_seed

logger = logging.getLogger(__name__)

__all__ = ["Acquired", "HiRadixCache", "InsertResult", "MatchResult"]


class HiRadixCache:
    """See docs/core.md for the API and a request's lifecycle."""

    # -- construction ------------------------------------------------------------------------

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
        clock: Callable[[], float] | None = None,
    ) -> None:
        """`sync`: agreement with the other tensor-parallel ranks (`hicache.sync`).
        `shared_storage`: every rank holds the same pages under the same keys (MLA's one
        latent): only the rank `sync.writes_shared` names writes L3; every rank reads it.
        `clock`: seconds, for soft pins (`retention_seconds`); default `time.time`."""
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
            raise ConfigError("namespace must be a 32-byte seed (hicache_client.keys.namespace_seed)")
        self.tree = RadixTree(ps)
        self.chain = KeyChain(self.namespace, ps)
        self.events = Emitter(self.chain, ps)
        self.events.sink = event_sink
        self.policy = make_policy(config.eviction_policy, config.eviction_config)
        self.device_candidates = Candidates(self.policy, device_candidate)
        self.host_candidates = Candidates(self.policy, host_candidate)
        self.counters = CacheStats()
        # Miss attribution (hicache.attribution): the bounded sketch of recently evicted pages.
        self.evicted = EvictedSketch() if config.miss_attribution else None
        self.host_inflight: dict[int, list[int]] = {}
        self._corrupt_before = 0  # corrupt pages counted by backends detached since
        self.controller = self._make_controller()
        self.prefetcher = Prefetcher(self)
        self.acks = Acks(self, self.prefetcher)
        # L3 admission, its sketch of declined pages, the soft pins (hicache.retention).
        self.keeper = Keeper(self, self.acks, clock or time.time)
        self.admission, self.declined = self.keeper.admission, self.keeper.declined
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
        if self.has_storage:
            logger.info(
                "L3 admission %s; retention_seconds soft-pins pages on device and host only "
                "(up to %gs): the %s backend gets no per-request TTL", self.admission.spec(),
                config.max_retention_seconds, self._storage_name(),
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
            if node.host_value is None and self.evicted is not None:
                self.evicted.add(self.chain.digests(node), left_cache(node))
        self.tree.set_value(node, pages)
        if pages is not None:
            self.events.stored(node, "device")

    def set_host(self, node: TreeNode, pages: list[int] | None) -> None:
        if pages is None and node.host_value is not None:
            self.events.removed(node, "host")
            if node.value is None and self.evicted is not None:
                self.evicted.add(self.chain.digests(node), left_cache(node))
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
        self.keeper.clear()
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

    # -- lookups -----------------------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int], extra_key: str | None = None) -> MatchResult:
        """Longest cached page-aligned prefix of `tokens`. Mutates nothing but access times."""
        ps = self.page_size
        m = self.tree.match(tuple(tokens), extra_key)
        tick = self.tree.clock()
        root = self.tree.root(extra_key)
        dev_pages: list[int] = []
        host_tokens = 0
        last_dev = root
        on_device = True
        seq = [(n, n.num_pages) for n in m.nodes]
        if m.partial is not None:
            seq.append((m.partial, m.partial_pages))
        for node, pages in seq:
            node.last_access = tick
            if on_device and node.value is not None:
                dev_pages.extend(node.value[:pages])
                last_dev = node
            else:
                on_device = False
                host_tokens += pages * ps
        last = seq[-1][0] if seq else root
        self.touch(last_dev)
        self.touch(last)
        return MatchResult(dev_pages, len(dev_pages) * ps, host_tokens, last_dev, last)

    def touch(self, node: TreeNode) -> None:
        self.device_candidates.push(node)
        self.host_candidates.push(node)

    # -- admission ---------------------------------------------------------------------------

    def acquire(
        self,
        tokens: Sequence[int],
        extra_key: str | None = None,
        request_id: str | None = None,
        input_tokens: int | None = None,
        count: bool = True,
        layerwise: bool = False,
    ) -> Acquired:
        """Admit a request: finish its prefetch, match, load host pages back, lock, count.

        With `layerwise` the load-back is issued layer by layer and not waited for: the caller
        makes the forward wait per layer on `Acquired.load` (and calls its `wait_all()` if it
        gives the pages back unread). Without it, the compute stream waits for the whole load.

        `count=False` leaves the hit counters alone; the caller then calls
        `record_admission(acq, input_tokens)` once the request really starts (an engine that
        may still give the prefix back, for lack of pages, counts each request once).
        """
        t = tuple(tokens)
        r = self._acquire(t, extra_key, request_id, layerwise)
        if count:
            self.record_admission(r, len(t) if input_tokens is None else input_tokens)
        self._after()
        return r

    def record_admission(self, acq: Acquired, input_tokens: int) -> None:
        """Count one admitted request of `input_tokens` prompt tokens and its per-tier hits."""
        self.keeper.admission.tick()
        st = self.counters
        st.requests += 1
        st.input_tokens += input_tokens
        st.device_hit_tokens += acq.device_hit_tokens
        st.host_hit_tokens += acq.host_hit_tokens
        st.storage_hit_tokens += acq.storage_hit_tokens
        if acq.outcomes is not None:
            # A block trace's last page may run past its prompt (Mooncake's partial blocks:
            # hits the hit-rate tool caps, counted whole by the counters above): the
            # attribution then covers every token looked up, as those counters do.
            looked_up = sum(acq.outcomes.values())
            add_into(st.prompt_outcomes, complete(acq.outcomes, max(input_tokens, looked_up)))
        if acq.storage_hit_tokens:
            st.storage_hit_requests += 1
        elif acq.host_hit_tokens:
            st.host_hit_requests += 1
        elif acq.device_hit_tokens:
            st.device_hit_requests += 1

    def _acquire(
        self, t: Tokens, extra_key: str | None, request_id: str | None, layerwise: bool = False
    ) -> Acquired:
        ps = self.page_size
        cfg = self.config
        self.keeper.expire()
        from_storage = self.prefetcher.take(request_id) if request_id is not None else 0
        note = self.prefetcher.notes.pop(request_id, None) if request_id is not None else None
        unprobed = self.prefetcher.unprobed.pop(request_id, "below_prefetch_floor") \
            if request_id is not None else "below_prefetch_floor"
        nodes = self.tree.match_split(t, extra_key)
        root = self.tree.root(extra_key)
        n_dev = 0
        while n_dev < len(nodes) and nodes[n_dev].value is not None:
            n_dev += 1
        dev_nodes, host_nodes = nodes[:n_dev], nodes[n_dev:]
        last_dev = dev_nodes[-1] if dev_nodes else root
        end = last_dev
        dev_tokens = sum(len(x.key) for x in dev_nodes)
        host_tokens = sum(len(x.key) for x in host_nodes)
        loaded = wanted = 0
        load: list[TreeNode] = []
        counter: LayerDoneCounter | None = None
        if host_nodes:
            # Load only the leading host nodes cheaper to load than to recompute (cost model).
            plan = self.controller.plan_load(host_tokens, 0, ps)
            for x in host_nodes:
                if loaded + len(x.key) > plan.host_tokens:
                    break
                load.append(x)
                loaded += len(x.key)
            wanted = loaded
            if load and loaded >= cfg.load_back_threshold:
                counter = self._load_back(last_dev, load, layerwise)
            if counter is None:
                load, loaded = [], 0
            if load:
                end = load[-1]
            self.counters.load_back_skipped_tokens += host_tokens - loaded
        # The pages this request's prefetch brought are the deepest host nodes: a load cut
        # short (cost model, threshold, device room) leaves them out first.
        storage_hit = min(from_storage, max(0, loaded - (host_tokens - from_storage)))
        self.prefetcher.admitted(from_storage, storage_hit, host_tokens - wanted, wanted)
        tick = self.tree.clock()
        used = nodes[: n_dev + len(load)] if loaded else dev_nodes
        for x in used:
            x.hit_count += 1
            x.last_access = tick
        self.keeper.reused(used)
        self.tree.inc_lock(end)
        # Write-through catch-up: back up matched device nodes that have no host copy yet.
        if self.host_enabled and used:
            if cfg.write_policy == "write_through":
                self._write_backup(end)
            elif cfg.write_policy == "write_through_selective":
                for x in reversed(used):
                    if x.hit_count >= cfg.write_through_threshold:
                        if x.host_value is None:
                            self._write_backup(x)
                        break
        if cfg.host_memory_mode == "buffer_only":
            # Staged copies: loaded (or not used), or of prefix pages that are in L3 (a pin
            # held them when their backup was acked). Never a copy a write is still filling.
            loaded_or_unused = set(map(id, host_nodes))
            trim(self, [x for x in reversed(nodes) if id(x) in loaded_or_unused or x.stored])
        host_hit = loaded - storage_hit
        pages: list[int] = []
        for x in used:
            pages.extend(x.value)  # type: ignore[arg-type]
        outcomes = None if self.evicted is None else attribute(
            self, t, extra_key, nodes[-1] if nodes else root, dev_tokens, host_tokens, wanted,
            loaded, storage_hit, note, unprobed)
        return Acquired(
            pages, len(pages) * ps, end, dev_tokens, host_hit, storage_hit, counter, outcomes
        )

    def _load_back(
        self, last_dev: TreeNode, host_nodes: list[TreeNode], layerwise: bool = False
    ) -> LayerDoneCounter | None:
        """host -> device for the whole host-only chain below `last_dev` (issued layer by
        layer with `layerwise`); all or nothing (None: no device room)."""
        n = sum(x.num_pages for x in host_nodes)
        self.tree.inc_lock(last_dev)
        self.tree.inc_host_ref(host_nodes[-1])
        try:
            dev = self._alloc_device(n)
        finally:
            self.unpinned(self.tree.dec_host_ref(host_nodes[-1]))
            self.unpinned(self.tree.dec_lock(last_dev))
        if dev is None:
            return None
        host: list[int] = []
        for x in host_nodes:
            host.extend(x.host_value)  # type: ignore[arg-type]
        counter = self.controller.load(host, dev, layerwise=layerwise)
        off = 0
        for x in host_nodes:
            k = len(x.host_value)  # type: ignore[arg-type]
            self.set_device(x, dev[off : off + k])
            off += k
        self.counters.load_back_tokens += n * self.page_size
        self.device_candidates.push(host_nodes[-1])
        return counter

    # -- pages -------------------------------------------------------------------------------

    def alloc_device(self, n_pages: int) -> list[int] | None:
        """`n_pages` free device pages, evicting cached pages as needed; None if impossible."""
        r = self._alloc_device(n_pages)
        self._after()
        return r

    def _alloc_device(self, n: int) -> list[int] | None:
        short = n - self.device_alloc.num_free
        if short > 0:
            self._evict(short * self.page_size)
        return self.device_alloc.alloc(n)

    def _alloc_host_pinned(self, node: TreeNode, n: int) -> list[int] | None:
        """`alloc_host` with `node`'s path locked, so the host eviction it may trigger cannot
        take `node` or its ancestors."""
        self.tree.inc_lock(node)
        try:
            return self.alloc_host(n)
        finally:
            self.unpinned(self.tree.dec_lock(node))

    def alloc_host(self, n: int) -> list[int] | None:
        if n > self.host_alloc.num_pages:
            return None
        short = n - self.host_alloc.num_free
        if short > 0:
            self._evict_host(short * self.page_size)
        return self.host_alloc.alloc(n)

    # -- insertion ---------------------------------------------------------------------------

    def insert(
        self,
        tokens: Sequence[int],
        device_pages: Sequence[int],
        extra_key: str | None = None,
        priority: int = 0,
        *,
        skip_write: bool = False,
        retention_s: float = 0.0,
    ) -> InsertResult:
        """Cache the full pages of `tokens`, whose KV is in `device_pages` (one per page).

        The tree takes the caller's pages where it has none (new nodes, and host-only nodes the
        caller recomputed), frees the caller's pages that duplicate pages it already holds, and
        returns its own pages for the range: the caller must use those from now on.

        The request's hints (`hicache.admission.CacheHints`): `skip_write` keeps the pages it
        adds on the device only, first to be evicted; `retention_s` soft-pins the whole
        sequence for that long (at most `max_retention_seconds`).
        """
        r = self._insert(tuple(tokens), list(device_pages), extra_key, priority, skip_write)
        if retention_s > 0 and r.node.parent is not None:
            self.keeper.retain(r.node, retention_s)
        self._after()
        return r

    def _insert(
        self, t: Tokens, pages_in: list[int], extra_key: str | None, priority: int,
        skip_write: bool = False,
    ) -> InsertResult:
        ps = self.page_size
        n_pages = len(t) // ps
        if len(pages_in) < n_pages:
            raise ValueError(f"{len(pages_in)} device pages for {n_pages} full pages of tokens")
        self.keeper.expire()
        pages = pages_in[:n_pages]
        node = self.tree.root(extra_key)
        tick = self.tree.clock()
        out: list[int] = []
        dups: list[int] = []
        new_tokens = 0
        fresh: list[TreeNode] = []  # nodes whose pages this request computed
        i = 0
        while i < n_pages:
            child = node.children.get(t[i * ps : (i + 1) * ps])
            if child is None:
                child = self.tree.new_child(node, t[i * ps : n_pages * ps])
                self.set_device(child, pages[i:])
                child.priority = priority
                child.hit_count = 1  # the request that computed it is its first use (SGLang)
                child.no_write = skip_write
                fresh.append(child)
                new_tokens += (n_pages - i) * ps
                out.extend(pages[i:])
                node = child
                break
            m = common_pages(child.key, t[i * ps : n_pages * ps], ps)
            if m < child.num_pages:
                child = self.tree.split(child, m)
            if child.value is None:
                # Re-attach: the caller recomputed these pages.
                self.set_device(child, pages[i : i + m])
                new_tokens += m * ps
                fresh.append(child)
            else:
                dups.extend(p for p, q in zip(pages[i : i + m], child.value) if p != q)
            out.extend(child.value)  # type: ignore[arg-type]  # set on both branches
            child.last_access = tick
            child.priority = max(child.priority, priority)
            if child.no_write and not skip_write:
                child.no_write = False  # a request without the hint uses them: keep them
            node = child
            i += m
        if dups:
            self.device_alloc.free(dups)
        if skip_write:
            self.counters.skip_write_pages += sum(x.num_pages for x in fresh if x.no_write)
        else:
            self.keeper.computed(fresh)
        if node.parent is not None:
            node.last_access = tick
            self.device_candidates.push(node)
            if self.host_enabled and (
                self.config.write_policy == "write_through"
                or self.config.write_policy == "write_through_selective"
                and node.hit_count >= self.config.write_through_threshold
            ):
                self._write_backup(node)
        return InsertResult(out, dups, node, new_tokens)

    def _write_backup(self, node: TreeNode) -> bool:
        """Start device -> host copies for `node` and every ancestor lacking a host copy, so
        host copies stay prefix-closed. All or nothing; False when host memory is short."""
        chain = [x for x in self.tree.path(node) if x.host_value is None and not x.stored]
        if not chain:
            return True
        if any(x.no_write for x in chain):
            return False  # skip_cache_write: device only
        chain.reverse()
        n = sum(x.num_pages for x in chain)
        host = self._alloc_host_pinned(node, n)
        if host is None:
            self.counters.backup_skipped_tokens += n * self.page_size
            return False
        off = 0
        for x in chain:
            k = len(x.value)  # type: ignore[arg-type]
            self.set_host(x, host[off : off + k])
            off += k
            keys = self.storage_keys(x) if self.has_storage else []
            self.tree.inc_lock(x)  # the device copy must stay until the host copy is written
            self.controller.submit_write(WriteOp(x, list(x.value), x.host_value, keys=keys))  # type: ignore[arg-type]
        return True

    # -- L3 admission and soft pins (hicache.retention) -------------------------------------

    def admit(self, node: TreeNode) -> bool:
        """Whether `node`'s pages go to L3 now (`Keeper.admit`)."""
        return self.keeper.admit(node)

    def retain(self, node: TreeNode, seconds: float) -> float:
        """Soft-pin `node` and its ancestors for `seconds` (`Keeper.retain`)."""
        return self.keeper.retain(node, seconds)

    # -- eviction ----------------------------------------------------------------------------

    def evict(self, n_tokens: int) -> int:
        """Evict at least `n_tokens` device tokens by policy if possible; return tokens evicted.
        Backed-up nodes become host-only; others leave the tree (write_back backs them up
        first)."""
        r = self._evict(n_tokens)
        self._after()
        return r

    def _evict(self, n_tokens: int) -> int:
        self.keeper.expire()
        evicted = 0
        skipped: list[TreeNode] = []
        if len(self.device_candidates.heap) > 4 * self.device_alloc.num_pages + 1024:
            self.device_candidates.rebuild(list(self.tree.nodes()))
        while evicted < n_tokens:
            node = self.device_candidates.pop()
            if node is None:
                break
            got = self._evict_device_node(node)
            if got == 0:
                skipped.append(node)
            evicted += got
        for x in skipped:
            self.device_candidates.push(x)
        return evicted

    def _evict_device_node(self, node: TreeNode) -> int:
        ps = self.page_size
        assert node.value is not None
        k = len(node.value)
        if node.host_value is None:
            keep = self.config.write_policy == "write_back" or bool(node.children)
            if node.stored and self.config.host_memory_mode == "buffer_only":
                keep = False  # its pages are in L3: no need to stage them again
            if node.no_write:
                keep = False  # skip_cache_write: never copied below the device
            if not (keep and self.host_enabled and self._backup_now(node)):
                if node.host_ref > 0:
                    return 0  # the node or a descendant is host-pinned; try later
                if node.children:
                    self._drop_subtree(node)
                    return k * ps
                parent = node.parent
                self.device_alloc.free(node.value)
                self.set_device(node, None)
                self.tree.remove_leaf(node)
                self.counters.evicted_tokens += k * ps
                assert parent is not None
                self.touch(parent)
                return k * ps
        self.device_alloc.free(node.value)
        self.set_device(node, None)
        self.counters.evicted_tokens += k * ps
        self.host_candidates.push(node)
        if node.parent is not None:
            self.device_candidates.push(node.parent)
        return k * ps

    def _backup_now(self, node: TreeNode) -> bool:
        """Synchronous device -> host copy of `node` (eviction under write_back)."""
        assert node.value is not None
        k = len(node.value)
        host = self._alloc_host_pinned(node, k)
        if host is None:
            self.counters.backup_skipped_tokens += k * self.page_size
            return False
        self.controller.write_now(node.value, host)
        self.set_host(node, host)
        self.counters.backup_tokens += k * self.page_size
        buffer = self.config.host_memory_mode == "buffer_only"
        if (buffer or self.config.write_policy != "write_back") and self.admit(node):
            self.acks.backup(node, list(host), self.storage_keys(node))
        return True

    def _drop_subtree(self, node: TreeNode) -> None:
        """Remove `node` and all its (host-only) descendants, freeing their pages."""
        stack = [node]
        order: list[TreeNode] = []
        while stack:
            x = stack.pop()
            order.append(x)
            stack.extend(x.children.values())
        ps = self.page_size
        for x in reversed(order):  # leaves first
            if x.value is not None:
                self.device_alloc.free(x.value)
                self.counters.evicted_tokens += len(x.value) * ps
                self.set_device(x, None)
            if x.host_value is not None:
                self.host_alloc.free(x.host_value)
                self.counters.evicted_host_tokens += len(x.host_value) * ps
                self.set_host(x, None)
            parent = x.parent
            self.tree.remove_leaf(x)
            if x is node and parent is not None:
                self.touch(parent)

    def evict_host(self, n_tokens: int) -> int:
        """Drop at least `n_tokens` host tokens of nodes already off the device and unpinned."""
        r = self._evict_host(n_tokens)
        self._after()
        return r

    def _evict_host(self, n_tokens: int) -> int:
        ps = self.page_size
        self.keeper.expire()
        evicted = 0
        if len(self.host_candidates.heap) > 4 * self.host_alloc.num_pages + 1024:
            self.host_candidates.rebuild(list(self.tree.nodes()))
        while evicted < n_tokens:
            node = self.host_candidates.pop()
            if node is None:
                break
            host = node.host_value
            assert host is not None
            write = (
                self.config.write_policy == "write_back"
                and self.has_storage
                and self.controller.storage_usable()
                and self.admit(node)
            )
            keys = self.storage_keys(node) if write else []
            parent = node.parent
            if write:
                self.acks.backup_detached(node, host, keys)
            self.set_host(node, None)
            self.tree.remove_leaf(node)
            if not write:
                self.host_alloc.free(host)
            evicted += len(host) * ps
            self.counters.evicted_host_tokens += len(host) * ps
            assert parent is not None
            self.touch(parent)
        return evicted

    # -- L3 prefetch (hicache.prefetch) ----------------------------------------------------

    def prefetch(
        self, request_id: str, tokens: Sequence[int], extra_key: str | None = None
    ) -> int:
        """Start fetching from L3 the pages of `tokens` beyond what device and host hold: the
        prefetch worker asks L3 which it has, then host pages are reserved for those and read
        (`hicache.prefetch`). Returns the tokens asked of L3 (0: not started: no L3 or L3
        backing off, below `prefetch_threshold`, or the host share for prefetches used up)."""
        r = self.prefetcher.start(request_id, tuple(tokens), extra_key)
        self._after()
        return r

    def prefetch_ready(self, request_id: str) -> bool:
        """Whether the prefetch policy lets request `request_id` be scheduled now (applies
        finished transfers first: a finished L3 probe starts its fetch)."""
        self.poll()
        return self.prefetcher.ready(request_id)

    def prefetch_progress(self, request_id: str) -> tuple[int, int]:
        """(pages fetched so far, pages being fetched) of a pending prefetch; (0, 0) when none
        or while L3 is still being asked which pages it has."""
        self.poll()
        return self.prefetcher.progress(request_id)

    def cancel_prefetch(self, request_id: str) -> None:
        """Drop the prefetch of a request that went away (its host pages are given back as
        soon as the worker has stopped touching them)."""
        self.prefetcher.cancel(request_id)
        self._after()

    def __enter__(self) -> HiRadixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
