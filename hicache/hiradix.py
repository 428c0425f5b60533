"""`HiRadixCache`: the tiered KV cache (device L1, host L2, storage L3) over a radix tree.

Tier states of a node: device only, device + host, host only. A node on neither leaves the tree.
L3 presence is not mirrored in the tree; it is asked of the backend when a request arrives.

Invariants (`check_integrity` verifies them all):
- every non-root node has device pages or host pages, one per page of its key;
- device residency is prefix-closed: a node on the device has its parent on the device;
- a page id is owned by exactly one node (or one in-flight transfer), and is allocated;
- host pages = tree host pages + pages held by in-flight transfers + free pages;
- pins are path-wide: a node's `lock_ref` / `host_ref` >= the sum of its children's.

Only one thread (the owner: the engine's scheduler) calls into this object. Background transfers
run in `TransferController`; their results are applied in `poll()`.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections.abc import Callable, Sequence
from itertools import count
from typing import NamedTuple

from hicache.config import HiCacheConfig
from hicache.controller import (
    BackupOp,
    Op,
    PrefetchOp,
    TensorTransfer,
    Transfer,
    TransferController,
    WriteOp,
)
from hicache.errors import ConfigError
from hicache.eviction import EvictionPolicy, SortKey, make_policy
from hicache.keys import namespace_seed, page_keys, request_seed
from hicache.pools import DeviceKVPool, HostKVPool, PageAllocator, dtype_name
from hicache.radix import RadixTree, Tokens, TreeNode, common_pages
from hicache.simulation import SimStorage, SimTransfer
from hicache.stats import CacheStats
from hicache.storage import (
    BackendStats,
    PageCodec,
    StorageBackend,
    StorageConfig,
    create_backend,
)

logger = logging.getLogger(__name__)


class MatchResult(NamedTuple):
    device_pages: list[int]  # device pages of the cached prefix; valid only while locked
    device_tokens: int  # leading tokens on the device
    host_tokens: int  # tokens after those, cached in host memory only
    last_device_node: TreeNode  # deepest node holding matched device pages (may end past them)
    last_host_node: TreeNode  # deepest matched node, on device or host (root when nothing)


class Acquired(NamedTuple):
    device_pages: list[int]  # pages of the cached prefix, on the device, locked
    cached_tokens: int  # len(device_pages) * page_size
    node: TreeNode  # locked; give it back with release(node)
    device_hit_tokens: int  # already on the device
    host_hit_tokens: int  # loaded back from host memory
    storage_hit_tokens: int  # prefetched from L3 for this request, then loaded back


class InsertResult(NamedTuple):
    device_pages: list[int]  # the tree's pages for the inserted full pages: use these from now on
    duplicate_pages: list[int]  # caller pages that duplicated the tree's; already freed
    node: TreeNode  # deepest node of the inserted sequence (not locked)
    new_tokens: int  # tokens the tree took pages for (new nodes and re-attached host nodes)


class _Candidates:
    """Lazy min-heap of eviction candidates. Entries go stale when a node's key changes or it
    stops being a candidate; they are checked when popped. Push whenever a node may have become
    a candidate or its key may have changed."""

    def __init__(self, policy: EvictionPolicy, valid: Callable[[TreeNode], bool]) -> None:
        self.policy = policy
        self.valid = valid
        self.heap: list[tuple[SortKey, int, TreeNode]] = []
        self._seq = count()

    def push(self, node: TreeNode) -> None:
        if node.parent is not None and self.valid(node):
            heapq.heappush(self.heap, (self.policy.key(node), next(self._seq), node))

    def pop(self) -> TreeNode | None:
        while self.heap:
            key, _, node = heapq.heappop(self.heap)
            if self.valid(node) and self.policy.key(node) == key:
                return node
        return None

    def rebuild(self, nodes: Sequence[TreeNode]) -> None:
        self.heap = [(self.policy.key(n), next(self._seq), n) for n in nodes if self.valid(n)]
        heapq.heapify(self.heap)


def _device_candidate(n: TreeNode) -> bool:
    return not n.removed and n.value is not None and n.lock_ref == 0 and n.device_children == 0


def _host_candidate(n: TreeNode) -> bool:
    return (
        not n.removed
        and n.value is None
        and n.host_value is not None
        and not n.children
        and n.host_ref == 0
        and n.lock_ref == 0
    )


class HiRadixCache:
    """See docs/core.md for the API and a request's lifecycle."""

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
    ) -> None:
        self.config = config
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
                    num_host_pages or self._host_pages_for(device_pool),
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
        if len(self.namespace) != 32:
            raise ConfigError("namespace must be a 32-byte seed (hicache.keys.namespace_seed)")
        self.tree = RadixTree(ps)
        self.policy = make_policy(config.eviction_policy, config.eviction_config)
        self._device_heap = _Candidates(self.policy, _device_candidate)
        self._host_heap = _Candidates(self.policy, _host_candidate)
        self._stats = CacheStats()
        self._prefetches: dict[str, PrefetchOp] = {}
        # Host pages owned by in-flight operations rather than by tree nodes.
        self._host_inflight: dict[int, list[int]] = {}
        self._seeds: dict[str | None, bytes] = {}
        self.controller = self._make_controller()
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

    # ------------------------------------------------------------------------------------------
    # construction helpers
    # ------------------------------------------------------------------------------------------

    def _host_pages_for(self, device_pool: DeviceKVPool) -> int:
        cfg = self.config
        if cfg.host_size_gb > 0:
            page_bytes = device_pool.bytes_per_token * cfg.page_size
            return max(1, int(cfg.host_size_gb * 1e9) // page_bytes)
        return max(1, int(device_pool.num_pages * cfg.host_ratio))

    def _make_backend(self, name: str, extra: object) -> StorageBackend:
        assert self.host_pool is not None
        self.codec = self._make_codec()
        return create_backend(
            name,
            StorageConfig(
                extra=dict(extra or {}),  # type: ignore[call-overload]
                namespace=self.namespace.hex(),
                record_bytes=self.codec.record_bytes,
            ),
        )

    def _make_codec(self) -> PageCodec:
        assert self.host_pool is not None
        return PageCodec(
            namespace=self.namespace,
            dtype=dtype_name(self.host_pool.dtype),
            shape=self.host_pool.page_shape,
            layout=self.host_pool.layout,
            tokens_per_page=self.page_size,
            itemsize=self.host_pool.itemsize,
        )

    def _make_controller(self) -> TransferController:
        transfer: Transfer
        if self.simulated:
            transfer = SimTransfer(self.sim_storage)
            has_storage = self.sim_storage is not None
        else:
            assert self.device_pool is not None
            if self.storage is not None and self.codec is None:
                self.codec = self._make_codec()
            transfer = TensorTransfer(
                self.device_pool,
                self.host_pool,  # type: ignore[arg-type]
                self.storage,
                self.codec,
            )
            has_storage = self.storage is not None
        return TransferController(
            transfer,
            has_storage=has_storage,
            batch_pages=self.config.storage_batch_pages,
            retry_backoff_s=self.config.storage_retry_backoff,
            synchronous=self.config.synchronous or self.simulated,
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

    # ------------------------------------------------------------------------------------------
    # keys
    # ------------------------------------------------------------------------------------------

    def _seed(self, extra_key: str | None) -> bytes:
        s = self._seeds.get(extra_key)
        if s is None:
            s = self._seeds[extra_key] = request_seed(self.namespace, extra_key)
        return s

    def _last_digest(self, node: TreeNode) -> bytes:
        """Digest of the last page of `node` (the seed for a root), computing lazily."""
        if node.parent is None:
            return self._seed(node.extra_key)
        return self._digests(node)[-1]

    def _digests(self, node: TreeNode) -> list[bytes]:
        chain = []
        x = node
        while x.parent is not None and x.page_keys is None:
            chain.append(x)
            x = x.parent
        prior = self._seed(x.extra_key) if x.parent is None else x.page_keys[-1]  # type: ignore[index]
        for y in reversed(chain):
            y.page_keys = page_keys(y.key, self.page_size, prior)
            prior = y.page_keys[-1]
        assert node.page_keys is not None
        return node.page_keys

    def storage_keys(self, node: TreeNode) -> list[str]:
        """The L3 keys of `node`'s pages."""
        return [d.hex() for d in self._digests(node)]

    # ------------------------------------------------------------------------------------------
    # lookups
    # ------------------------------------------------------------------------------------------

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
        self._touch(last_dev)
        self._touch(last)
        return MatchResult(dev_pages, len(dev_pages) * ps, host_tokens, last_dev, last)

    def _touch(self, node: TreeNode) -> None:
        self._device_heap.push(node)
        self._host_heap.push(node)

    # ------------------------------------------------------------------------------------------
    # admission
    # ------------------------------------------------------------------------------------------

    def acquire(
        self,
        tokens: Sequence[int],
        extra_key: str | None = None,
        request_id: str | None = None,
        input_tokens: int | None = None,
        count: bool = True,
    ) -> Acquired:
        """Admit a request: finish its prefetch, match, load host pages back, lock, count.

        `count=False` leaves the hit counters alone; the caller then calls
        `record_admission(acq, input_tokens)` once the request really starts (an engine that
        may still give the prefix back, for lack of pages, counts each request once).
        """
        t = tuple(tokens)
        r = self._acquire(t, extra_key, request_id)
        if count:
            self.record_admission(r, len(t) if input_tokens is None else input_tokens)
        self._after()
        return r

    def record_admission(self, acq: Acquired, input_tokens: int) -> None:
        """Count one admitted request of `input_tokens` prompt tokens and its per-tier hits."""
        st = self._stats
        st.requests += 1
        st.input_tokens += input_tokens
        st.device_hit_tokens += acq.device_hit_tokens
        st.host_hit_tokens += acq.host_hit_tokens
        st.storage_hit_tokens += acq.storage_hit_tokens
        if acq.storage_hit_tokens:
            st.storage_hit_requests += 1
        elif acq.host_hit_tokens:
            st.host_hit_requests += 1
        elif acq.device_hit_tokens:
            st.device_hit_requests += 1

    def _acquire(self, t: Tokens, extra_key: str | None, request_id: str | None) -> Acquired:
        ps = self.page_size
        cfg = self.config
        from_storage = 0
        op = self._prefetches.pop(request_id, None) if request_id is not None else None
        if op is not None:
            from_storage = self._finish_prefetch(op)
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
        loaded = 0
        if host_nodes:
            if host_tokens >= cfg.load_back_threshold and self._load_back(last_dev, host_nodes):
                loaded = host_tokens
                end = host_nodes[-1]
            else:
                self._stats.load_back_skipped_tokens += host_tokens
        tick = self.tree.clock()
        used = nodes[: n_dev + (len(host_nodes) if loaded else 0)]
        for x in used:
            x.hit_count += 1
            x.last_access = tick
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
        storage_hit = min(from_storage, loaded)
        host_hit = loaded - storage_hit
        pages: list[int] = []
        for x in used:
            pages.extend(x.value)  # type: ignore[arg-type]
        return Acquired(pages, len(pages) * ps, end, dev_tokens, host_hit, storage_hit)

    def _load_back(self, last_dev: TreeNode, host_nodes: list[TreeNode]) -> bool:
        """host -> device for the whole host-only chain below `last_dev`; all or nothing."""
        n = sum(x.num_pages for x in host_nodes)
        self.tree.inc_lock(last_dev)
        self.tree.inc_host_ref(host_nodes[-1])
        try:
            dev = self._alloc_device(n)
        finally:
            self._released(self.tree.dec_host_ref(host_nodes[-1]))
            self._released(self.tree.dec_lock(last_dev))
        if dev is None:
            return False
        host: list[int] = []
        for x in host_nodes:
            host.extend(x.host_value)  # type: ignore[arg-type]
        self.controller.load(host, dev)
        off = 0
        for x in host_nodes:
            k = len(x.host_value)  # type: ignore[arg-type]
            self.tree.set_value(x, dev[off : off + k])
            off += k
        self._stats.load_back_tokens += n * self.page_size
        self._device_heap.push(host_nodes[-1])
        return True

    def lock(self, node: TreeNode) -> None:
        """Pin `node` and its ancestors on the device (they cannot be evicted until unlocked)."""
        self.tree.inc_lock(node)

    def unlock(self, node: TreeNode) -> None:
        self._released(self.tree.dec_lock(node))

    release = unlock

    def _released(self, nodes: list[TreeNode]) -> None:
        for x in nodes:
            self._device_heap.push(x)
            self._host_heap.push(x)

    # ------------------------------------------------------------------------------------------
    # device pages
    # ------------------------------------------------------------------------------------------

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

    def free_device(self, pages: Sequence[int]) -> None:
        """Give back device pages the caller did not hand to the tree."""
        self.device_alloc.free(pages)

    def _alloc_host_pinned(self, node: TreeNode, n: int) -> list[int] | None:
        """`_alloc_host` with `node`'s path locked, so the host eviction it may trigger cannot
        take `node` or its ancestors."""
        self.tree.inc_lock(node)
        try:
            return self._alloc_host(n)
        finally:
            self._released(self.tree.dec_lock(node))

    def _alloc_host(self, n: int) -> list[int] | None:
        if n > self.host_alloc.num_pages:
            return None
        short = n - self.host_alloc.num_free
        if short > 0:
            self._evict_host(short * self.page_size)
        return self.host_alloc.alloc(n)

    # ------------------------------------------------------------------------------------------
    # insertion and write policies
    # ------------------------------------------------------------------------------------------

    def insert(
        self,
        tokens: Sequence[int],
        device_pages: Sequence[int],
        extra_key: str | None = None,
        priority: int = 0,
    ) -> InsertResult:
        """Cache the full pages of `tokens`, whose KV is in `device_pages` (one per page).

        The tree takes the caller's pages where it has none (new nodes, and host-only nodes the
        caller recomputed), frees the caller's pages that duplicate pages it already holds, and
        returns its own pages for the range: the caller must use those from now on.
        """
        r = self._insert(tuple(tokens), list(device_pages), extra_key, priority)
        self._after()
        return r

    def _insert(
        self, t: Tokens, pages_in: list[int], extra_key: str | None, priority: int
    ) -> InsertResult:
        ps = self.page_size
        n_pages = len(t) // ps
        if len(pages_in) < n_pages:
            raise ValueError(f"{len(pages_in)} device pages for {n_pages} full pages of tokens")
        pages = pages_in[:n_pages]
        node = self.tree.root(extra_key)
        tick = self.tree.clock()
        out: list[int] = []
        dups: list[int] = []
        new_tokens = 0
        i = 0
        while i < n_pages:
            child = node.children.get(t[i * ps : (i + 1) * ps])
            if child is None:
                child = self.tree.new_child(node, t[i * ps : n_pages * ps])
                self.tree.set_value(child, pages[i:])
                child.priority = priority
                new_tokens += (n_pages - i) * ps
                out.extend(pages[i:])
                node = child
                break
            m = common_pages(child.key, t[i * ps : n_pages * ps], ps)
            if m < child.num_pages:
                child = self.tree.split(child, m)
            if child.value is None:
                # Re-attach: the caller recomputed these pages.
                self.tree.set_value(child, pages[i : i + m])
                new_tokens += m * ps
            else:
                dups.extend(p for p, q in zip(pages[i : i + m], child.value) if p != q)
            out.extend(child.value)  # type: ignore[arg-type]  # set on both branches
            child.last_access = tick
            child.priority = max(child.priority, priority)
            node = child
            i += m
        if dups:
            self.device_alloc.free(dups)
        if node.parent is not None:
            node.last_access = tick
            self._device_heap.push(node)
            if self.config.write_policy == "write_through" and self.host_enabled:
                self._write_backup(node)
        return InsertResult(out, dups, node, new_tokens)

    def _write_backup(self, node: TreeNode) -> bool:
        """Start device -> host copies for `node` and every ancestor lacking a host copy, so
        host copies stay prefix-closed. All or nothing; False when host memory is short."""
        chain = [x for x in self.tree.path(node) if x.host_value is None]
        if not chain:
            return True
        chain.reverse()
        n = sum(x.num_pages for x in chain)
        host = self._alloc_host_pinned(node, n)
        if host is None:
            self._stats.backup_skipped_tokens += n * self.page_size
            return False
        off = 0
        for x in chain:
            k = len(x.value)  # type: ignore[arg-type]
            x.host_value = host[off : off + k]
            off += k
            keys = self.storage_keys(x) if self.has_storage else []
            self.tree.inc_lock(x)  # the device copy must stay until the host copy is written
            self.controller.submit_write(WriteOp(x, list(x.value), x.host_value, keys=keys))  # type: ignore[arg-type]
        return True

    # ------------------------------------------------------------------------------------------
    # eviction
    # ------------------------------------------------------------------------------------------

    def evict(self, n_tokens: int) -> int:
        """Evict at least `n_tokens` device tokens by policy if possible; return tokens evicted.
        Backed-up nodes become host-only; others leave the tree (write_back backs them up
        first)."""
        r = self._evict(n_tokens)
        self._after()
        return r

    def _evict(self, n_tokens: int) -> int:
        evicted = 0
        skipped: list[TreeNode] = []
        if len(self._device_heap.heap) > 4 * self.device_alloc.num_pages + 1024:
            self._device_heap.rebuild(list(self.tree.nodes()))
        while evicted < n_tokens:
            node = self._device_heap.pop()
            if node is None:
                break
            got = self._evict_device_node(node)
            if got == 0:
                skipped.append(node)
            evicted += got
        for x in skipped:
            self._device_heap.push(x)
        return evicted

    def _evict_device_node(self, node: TreeNode) -> int:
        ps = self.page_size
        assert node.value is not None
        k = len(node.value)
        if node.host_value is None:
            keep = self.config.write_policy == "write_back" or bool(node.children)
            if not (keep and self.host_enabled and self._backup_now(node)):
                if node.children:
                    if node.host_ref > 0:
                        return 0  # a descendant's host copy is being read; try later
                    self._drop_subtree(node)
                    return k * ps
                parent = node.parent
                self.device_alloc.free(node.value)
                self.tree.set_value(node, None)
                self.tree.remove_leaf(node)
                self._stats.evicted_tokens += k * ps
                assert parent is not None
                self._touch(parent)
                return k * ps
        self.device_alloc.free(node.value)
        self.tree.set_value(node, None)
        self._stats.evicted_tokens += k * ps
        self._host_heap.push(node)
        if node.parent is not None:
            self._device_heap.push(node.parent)
        return k * ps

    def _backup_now(self, node: TreeNode) -> bool:
        """Synchronous device -> host copy of `node` (eviction under write_back)."""
        assert node.value is not None
        k = len(node.value)
        host = self._alloc_host_pinned(node, k)
        if host is None:
            self._stats.backup_skipped_tokens += k * self.page_size
            return False
        self.controller.write_now(node.value, host)
        node.host_value = host
        self._stats.backup_tokens += k * self.page_size
        if self.config.write_policy != "write_back":
            self._backup_to_storage(node)
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
                self._stats.evicted_tokens += len(x.value) * ps
                self.tree.set_value(x, None)
            if x.host_value is not None:
                self.host_alloc.free(x.host_value)
                self._stats.evicted_host_tokens += len(x.host_value) * ps
                x.host_value = None
            parent = x.parent
            self.tree.remove_leaf(x)
            if x is node and parent is not None:
                self._touch(parent)

    def evict_host(self, n_tokens: int) -> int:
        """Drop at least `n_tokens` host tokens of nodes already off the device and unpinned."""
        r = self._evict_host(n_tokens)
        self._after()
        return r

    def _evict_host(self, n_tokens: int) -> int:
        ps = self.page_size
        evicted = 0
        if len(self._host_heap.heap) > 4 * self.host_alloc.num_pages + 1024:
            self._host_heap.rebuild(list(self.tree.nodes()))
        while evicted < n_tokens:
            node = self._host_heap.pop()
            if node is None:
                break
            host = node.host_value
            assert host is not None
            write = (
                self.config.write_policy == "write_back"
                and self.has_storage
                and self.controller.storage_available()
            )
            keys = self.storage_keys(node) if write else []
            parent = node.parent
            node.host_value = None
            self.tree.remove_leaf(node)
            if write:
                op = BackupOp(None, host, keys)
                self._host_inflight[id(op)] = host
                self.controller.submit_backup(op)
            else:
                self.host_alloc.free(host)
            evicted += len(host) * ps
            self._stats.evicted_host_tokens += len(host) * ps
            assert parent is not None
            self._touch(parent)
        return evicted

    # ------------------------------------------------------------------------------------------
    # L3
    # ------------------------------------------------------------------------------------------

    def _backup_to_storage(self, node: TreeNode) -> None:
        if not self.has_storage or node.host_value is None:
            return
        keys = self.storage_keys(node)
        self.tree.inc_host_ref(node)
        self.controller.submit_backup(BackupOp(node, list(node.host_value), keys))

    def prefetch(
        self, request_id: str, tokens: Sequence[int], extra_key: str | None = None
    ) -> int:
        """Start fetching from L3 the pages of `tokens` beyond what device and host hold.

        Asks the backend now which leading pages it has, reserves host pages for them, and lets
        the prefetch worker read them in batches. Returns the tokens it will fetch (0: not
        started: no L3, below `prefetch_threshold`, nothing stored, or no host room).
        """
        r = self._prefetch(request_id, tuple(tokens), extra_key)
        self._after()
        return r

    def _prefetch(self, rid: str, t: Tokens, extra_key: str | None) -> int:
        ps = self.page_size
        cfg = self.config
        if not self.has_storage or rid in self._prefetches:
            return 0
        nodes = self.tree.match_split(t, extra_key)
        matched = sum(x.num_pages for x in nodes)
        remaining = len(t) // ps - matched
        if remaining <= 0 or remaining * ps < cfg.prefetch_threshold:
            self._stats.prefetch_skipped += 1
            return 0
        anchor = nodes[-1] if nodes else self.tree.root(extra_key)
        digests = page_keys(t[matched * ps : (matched + remaining) * ps], ps, self._last_digest(anchor))
        keys = [d.hex() for d in digests]
        n = self.controller.exists(keys)
        if n * ps < cfg.prefetch_threshold or n == 0:
            self._stats.prefetch_skipped += 1
            return 0
        self.tree.inc_lock(anchor)
        host = self._alloc_host(n)
        if host is None:
            self._released(self.tree.dec_lock(anchor))
            self._stats.prefetch_skipped += 1
            return 0
        op = PrefetchOp(
            request_id=rid,
            anchor=anchor,
            tokens=t,
            start_page=matched,
            keys=keys[:n],
            host_pages=host,
            started=time.monotonic(),
            budget_s=cfg.prefetch_timeout(n * ps),
        )
        self._prefetches[rid] = op
        self._host_inflight[id(op)] = host
        self._stats.prefetch_started += 1
        self.controller.submit_prefetch(op)
        return n * ps

    def prefetch_ready(self, request_id: str) -> bool:
        """Whether the prefetch policy lets request `request_id` be scheduled now."""
        op = self._prefetches.get(request_id)
        if op is None or op.done.is_set():
            return True
        policy = self.config.prefetch_policy
        if policy == "best_effort":
            return True
        if policy == "wait_complete":
            return False
        return time.monotonic() - op.started >= op.budget_s

    def prefetch_progress(self, request_id: str) -> tuple[int, int]:
        """(pages fetched so far, pages asked) of a pending prefetch; (0, 0) when none."""
        op = self._prefetches.get(request_id)
        return (op.completed, len(op.keys)) if op else (0, 0)

    def cancel_prefetch(self, request_id: str) -> None:
        """Drop the prefetch of a request that went away. Its host pages are given back as soon
        as the worker has stopped touching them."""
        op = self._prefetches.pop(request_id, None)
        if op is None:
            return
        op.cancelled = True
        op.stop.set()
        self._released(self.tree.dec_lock(op.anchor))
        if op.done.is_set():
            self._release_prefetch(op)
        self._after()

    def _finish_prefetch(self, op: PrefetchOp) -> int:
        """Insert the pages fetched so far as host-only nodes; return the new tokens."""
        take = op.completed
        op.stop.set()
        op.taken = take
        new_tokens, dups = self._insert_host_pages(op, take)
        if dups:
            self.host_alloc.free(dups)
            self._stats.prefetch_revoked_pages += len(dups)
        self._host_inflight[id(op)] = op.host_pages[take:]
        self._released(self.tree.dec_lock(op.anchor))
        if op.done.is_set():
            self._release_prefetch(op)
        return new_tokens

    def _insert_host_pages(self, op: PrefetchOp, take: int) -> tuple[int, list[int]]:
        ps = self.page_size
        t = op.tokens
        node = op.anchor
        base = op.start_page
        dups: list[int] = []
        j = 0
        while j < take:
            lo = (base + j) * ps
            child = node.children.get(t[lo : lo + ps])
            if child is None:
                child = self.tree.new_child(node, t[lo : (base + take) * ps])
                child.host_value = op.host_pages[j:take]
                child.page_keys = [bytes.fromhex(k) for k in op.keys[j:take]]
                self._host_heap.push(child)
                return (take - j) * ps, dups
            m = common_pages(child.key, t[lo : (base + take) * ps], ps)
            if m < child.num_pages:
                child = self.tree.split(child, m)
            if child.host_value is None:
                child.host_value = op.host_pages[j : j + m]  # a device-only node gains a copy
            else:
                dups.extend(op.host_pages[j : j + m])
            node = child
            j += m
        return 0, dups

    def _release_prefetch(self, op: PrefetchOp) -> None:
        """Free the host pages of `op` that no node took. Once, after the worker is done."""
        if op.released:
            return
        op.released = True
        left = self._host_inflight.pop(id(op), [])
        if left:
            self.host_alloc.free(left)
        fetched_unused = max(0, op.completed - (op.taken or 0))
        self._stats.prefetch_revoked_pages += fetched_unused

    # ------------------------------------------------------------------------------------------
    # acks
    # ------------------------------------------------------------------------------------------

    def poll(self) -> int:
        """Apply every completed background transfer; return how many were applied."""
        done = 0
        while True:
            acks = self.controller.acks()
            if not acks:
                return done
            for op in acks:
                self._apply(op)
                done += 1

    def _after(self) -> None:
        if self.controller.synchronous:
            self.poll()

    def _apply(self, op: Op) -> None:
        ps = self.page_size
        st = self._stats
        if isinstance(op, WriteOp):
            self._released(self.tree.dec_lock(op.node))
            if op.error is not None:
                self._drop_failed_write(op)
                return
            st.backup_tokens += len(op.host_pages) * ps
            if self.has_storage and not op.node.removed:
                self.tree.inc_host_ref(op.node)
                self.controller.submit_backup(BackupOp(op.node, op.host_pages, op.keys))
        elif isinstance(op, BackupOp):
            st.storage_backup_pages += op.written
            st.storage_backup_skipped_pages += op.skipped
            st.storage_failed_pages += op.failed
            st.storage_backup_bytes += op.nbytes
            st.storage_backup_seconds += op.seconds
            if op.node is not None:
                self._released_host(self.tree.dec_host_ref(op.node))
            else:
                self.host_alloc.free(self._host_inflight.pop(id(op)))
        else:
            st.prefetch_pages += op.completed
            st.prefetch_tokens += op.completed * ps
            st.prefetch_bytes += op.nbytes
            st.prefetch_seconds += op.seconds
            st.corrupt_pages += op.corrupt
            if op.taken is not None or op.cancelled:
                self._release_prefetch(op)

    def _released_host(self, nodes: list[TreeNode]) -> None:
        for x in nodes:
            self._host_heap.push(x)

    def _drop_failed_write(self, op: WriteOp) -> None:
        """A device -> host copy failed: forget the host copies it was to fill."""
        logger.error("device->host write failed (%s); dropping %d host pages", op.error,
                     len(op.host_pages))
        pages = set(op.host_pages)
        for x in self.tree.path(op.node):
            if x.host_value is not None and pages.issuperset(x.host_value):
                self.host_alloc.free(x.host_value)
                x.host_value = None

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every background transfer (and the ones their acks start) to finish."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.controller.wait_idle(left):
                raise TimeoutError("background transfers did not finish in time")
            if self.poll() == 0 and self.controller.pending == 0:
                return

    # ------------------------------------------------------------------------------------------
    # whole-cache operations
    # ------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop every cached page (L1 and L2; L3 is untouched). No node may be locked."""
        for rid in list(self._prefetches):
            self.cancel_prefetch(rid)
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
        self._device_heap.heap.clear()
        self._host_heap.heap.clear()

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
        for rid in list(self._prefetches):
            self.cancel_prefetch(rid)
        self.flush()
        self.controller.close()
        self.storage.close()
        self.storage = None
        self.controller = self._make_controller()

    def clear_storage(self) -> None:
        """Delete every page of the attached L3 backend (other instances' pages included).
        Waits for transfers in flight first. Call while idle."""
        if self.storage is None:
            raise ConfigError("no storage backend is attached")
        for rid in list(self._prefetches):
            self.cancel_prefetch(rid)
        self.flush()
        self.storage.clear()

    def close(self) -> None:
        try:
            self.flush(timeout=60)
        except TimeoutError:
            logger.warning("closing with transfers still running")
        self.controller.close()
        if self.storage is not None:
            self.storage.close()

    # ------------------------------------------------------------------------------------------
    # observation
    # ------------------------------------------------------------------------------------------

    @property
    def stats(self) -> CacheStats:
        s = self._stats.copy()
        s.storage_errors = self.controller.storage_errors
        return s

    def storage_stats(self) -> BackendStats | None:
        return self.storage.stats() if self.storage is not None else None

    def evictable_device_tokens(self) -> int:
        """Device tokens held by the tree and not locked (O(1)): what eviction could free."""
        return (self.tree.device_pages - self.tree.locked_device_pages) * self.page_size

    def usage(self) -> dict[str, int]:
        """Pool and tree occupancy, in pages and tokens."""
        ps = self.page_size
        dev = host = evictable = 0
        for x in self.tree.nodes():
            if x.value is not None:
                dev += len(x.value)
                if x.lock_ref == 0:
                    evictable += len(x.value)
            if x.host_value is not None:
                host += len(x.host_value)
        return {
            "page_size": ps,
            "device_pages_total": self.device_alloc.num_pages,
            "device_pages_free": self.device_alloc.num_free,
            "device_cached_tokens": dev * ps,
            "device_evictable_tokens": evictable * ps,
            "host_pages_total": self.host_alloc.num_pages,
            "host_pages_free": self.host_alloc.num_free,
            "host_cached_tokens": host * ps,
            "host_inflight_pages": sum(len(v) for v in self._host_inflight.values()),
            "pending_prefetches": len(self._prefetches),
            "pending_transfers": self.controller.pending,
            # Health: background transfer threads alive (3 unless synchronous), L3 backing off.
            "transfer_threads_alive": self.controller.threads_alive,
            "storage_down": int(self.controller.storage_down),
        }

    def check_integrity(self, outside_device_pages: int | None = None) -> None:
        """Raise AssertionError, with the numbers, when any invariant is broken.

        `outside_device_pages`: device pages the caller holds outside the tree (running
        requests); when given, tree pages + outside + free must equal the pool.
        """
        ps = self.page_size
        dev_seen: set[int] = set()
        host_seen: set[int] = set()
        for r in self.tree.roots.values():
            assert r.value == [] and r.host_value == [], "root holds pages"
            dc = sum(c.value is not None for c in r.children.values())
            assert r.device_children == dc, f"root: device_children {r.device_children} != {dc}"
        for x in self.tree.nodes():
            p = x.parent
            assert p is not None and not x.removed, f"{x} detached but reachable"
            assert p.children.get(x.key[:ps]) is x, f"{x} not under its parent's key"
            assert x.key and len(x.key) % ps == 0, f"{x} key of {len(x.key)} tokens"
            n = len(x.key) // ps
            assert x.value is not None or x.host_value is not None, f"{x} on no tier"
            if x.value is not None:
                assert len(x.value) == n, f"{x}: {len(x.value)} device pages for {n} pages"
                assert p.value is not None, f"{x} on device under a node that is not"
                for pg in x.value:
                    assert pg not in dev_seen, f"device page {pg} owned twice"
                    assert self.device_alloc.is_used(pg), f"device page {pg} in tree but free"
                    dev_seen.add(pg)
            if x.host_value is not None:
                assert len(x.host_value) == n, f"{x}: {len(x.host_value)} host pages for {n}"
                for pg in x.host_value:
                    assert pg not in host_seen, f"host page {pg} owned twice"
                    assert self.host_alloc.is_used(pg), f"host page {pg} in tree but free"
                    host_seen.add(pg)
            if x.page_keys is not None:
                assert len(x.page_keys) == n, f"{x}: {len(x.page_keys)} keys for {n} pages"
            dc = sum(c.value is not None for c in x.children.values())
            assert x.device_children == dc, f"{x}: device_children {x.device_children} != {dc}"
            assert x.lock_ref >= sum(c.lock_ref for c in x.children.values()), (
                f"{x}: lock_ref {x.lock_ref} < children's "
                f"{sum(c.lock_ref for c in x.children.values())}"
            )
            assert x.host_ref >= sum(c.host_ref for c in x.children.values()), (
                f"{x}: host_ref below its children's"
            )
            assert x.lock_ref >= 0 and x.host_ref >= 0, f"{x}: negative pin"
        locked = sum(len(x.value) for x in self.tree.nodes() if x.value is not None and x.lock_ref)
        assert self.tree.device_pages == len(dev_seen), (
            f"tree counts {self.tree.device_pages} device pages, holds {len(dev_seen)}"
        )
        assert self.tree.locked_device_pages == locked, (
            f"tree counts {self.tree.locked_device_pages} locked device pages, holds {locked}"
        )
        inflight: set[int] = set()
        for pages in self._host_inflight.values():
            for pg in pages:
                assert pg not in host_seen and pg not in inflight, f"host page {pg} owned twice"
                assert self.host_alloc.is_used(pg), f"in-flight host page {pg} is free"
                inflight.add(pg)
        used_host = self.host_alloc.num_used
        assert used_host == len(host_seen) + len(inflight), (
            f"host pool: used {used_host} != tree {len(host_seen)} + in-flight {len(inflight)}"
        )
        assert not (dev_seen & self.device_alloc.free_pages()), "tree device page is free"
        if outside_device_pages is not None:
            used = self.device_alloc.num_used
            assert used == len(dev_seen) + outside_device_pages, (
                f"device pool: used {used} != tree {len(dev_seen)} + outside "
                f"{outside_device_pages}"
            )
        for op in self._prefetches.values():
            assert not op.anchor.removed, "prefetch anchor left the tree"

    def __enter__(self) -> HiRadixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tokens_to_pages(n_tokens: int, page_size: int) -> int:
    return math.ceil(n_tokens / page_size)
