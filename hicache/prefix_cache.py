"""`PrefixCache`: what a scheduler needs of a prefix cache, and `NoPrefixCache`, the cache that
reuses nothing (`--disable-radix-cache`).

`HiRadixCache` implements the protocol; so does `NoPrefixCache`, so a scheduler has no "caching"
flag: it runs the same code over either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from hicache.pools import PageAllocator
from hicache.radix import RadixTree, TreeNode
from hicache.stats import CacheStats
from hicache.transfer import LayerDoneCounter
from hicache_client.backend import BackendStats


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
    # The load-back of the host-hit pages, issued layer by layer: the forward that first reads
    # them waits per layer (`merge_wait_layer`); `wait_all()` before the pages are given back.
    load: LayerDoneCounter | None = None
    # Each looked-up token's outcome (hicache.attribution.OUTCOMES; None: attribution is off).
    outcomes: dict[str, int] | None = None


class InsertResult(NamedTuple):
    device_pages: list[int]  # the tree's pages for the inserted full pages: use these from now on
    duplicate_pages: list[int]  # caller pages that duplicated the tree's; already freed
    node: TreeNode  # deepest node of the inserted sequence (not locked)
    new_tokens: int  # tokens the tree took pages for (new nodes and re-attached host nodes)


class PrefixCache(Protocol):
    """The calls a scheduler makes; see docs/core.md for their meaning in `HiRadixCache`."""

    page_size: int

    @property
    def stats(self) -> CacheStats: ...

    def prefetch(
        self, request_id: str, tokens: Sequence[int], extra_key: str | None = None
    ) -> int: ...

    def prefetch_ready(self, request_id: str) -> bool: ...

    def cancel_prefetch(self, request_id: str) -> None: ...

    def match_prefix(
        self, tokens: Sequence[int], extra_key: str | None = None
    ) -> MatchResult: ...

    def acquire(
        self,
        tokens: Sequence[int],
        extra_key: str | None = None,
        request_id: str | None = None,
        input_tokens: int | None = None,
        count: bool = True,
        layerwise: bool = False,
    ) -> Acquired: ...

    def record_admission(self, acq: Acquired, input_tokens: int) -> None: ...

    def lock(self, node: TreeNode) -> None: ...

    def release(self, node: TreeNode) -> None: ...

    def alloc_device(self, n_pages: int) -> list[int] | None: ...

    def free_device(self, pages: Sequence[int]) -> None: ...

    def insert(
        self,
        tokens: Sequence[int],
        device_pages: Sequence[int],
        extra_key: str | None = None,
        priority: int = 0,
        *,
        skip_write: bool = False,
        retention_s: float = 0.0,
    ) -> InsertResult: ...

    def evictable_device_tokens(self) -> int: ...

    def poll(self) -> int: ...

    def wait_progress(self, timeout: float) -> bool:
        """Block up to `timeout` s until a background transfer completes (instead of spinning
        while every waiting request waits on one); True when an ack is ready for `poll`."""
        ...

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A forward computed `tokens` prompt tokens in `seconds` (feeds load-vs-recompute)."""
        ...

    def flush(self, timeout: float | None = None) -> None: ...

    def reset(self) -> None: ...

    def usage(self) -> dict[str, int]: ...

    def storage_stats(self) -> BackendStats | None: ...

    def close(self) -> None: ...


class NoPrefixCache:
    """A prefix cache of capacity zero: nothing is ever matched, and the pages handed to
    `insert` are freed as soon as no lock holds them (at once at the next call, or when the
    lock that holds them is released)."""

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.counters = CacheStats()
        self._root = RadixTree(page_size).root(None)
        self._refs: dict[int, int] = {}  # page -> locks on it; pages handed over by insert
        self._orphans: list[int] = []  # handed over, not locked yet

    @property
    def stats(self) -> CacheStats:
        return self.counters.copy()

    def _drop_orphans(self) -> None:
        dead = [p for p in self._orphans if self._refs.get(p) == 0]
        self._orphans = []
        for p in dead:
            del self._refs[p]
        if dead:
            self.allocator.free(dead)

    def prefetch(
        self, request_id: str, tokens: Sequence[int], extra_key: str | None = None
    ) -> int:
        return 0

    def prefetch_ready(self, request_id: str) -> bool:
        return True

    def cancel_prefetch(self, request_id: str) -> None:
        pass

    def match_prefix(self, tokens: Sequence[int], extra_key: str | None = None) -> MatchResult:
        return MatchResult([], 0, 0, self._root, self._root)

    def acquire(
        self,
        tokens: Sequence[int],
        extra_key: str | None = None,
        request_id: str | None = None,
        input_tokens: int | None = None,
        count: bool = True,
        layerwise: bool = False,
    ) -> Acquired:
        acq = Acquired([], 0, self._root, 0, 0, 0)
        if count:
            self.record_admission(acq, len(tokens) if input_tokens is None else input_tokens)
        return acq

    def record_admission(self, acq: Acquired, input_tokens: int) -> None:
        self.counters.requests += 1
        self.counters.input_tokens += input_tokens

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
        self._drop_orphans()
        n = len(tokens) // self.page_size
        if len(device_pages) < n:
            raise ValueError(f"{len(device_pages)} device pages for {n} full pages of tokens")
        pages = list(device_pages[:n])
        node = TreeNode(-1, (), None, 0)  # a handle on the pages; lock() pins them
        node.value = pages
        for p in pages:
            if p not in self._refs:
                self._refs[p] = 0
                self._orphans.append(p)
        return InsertResult(pages, [], node, 0)

    def lock(self, node: TreeNode) -> None:
        for p in node.value or ():
            self._refs[p] += 1

    def release(self, node: TreeNode) -> None:
        dead = []
        for p in node.value or ():
            self._refs[p] -= 1
            if self._refs[p] == 0:
                dead.append(p)
        for p in dead:
            del self._refs[p]
        self._orphans = [p for p in self._orphans if p in self._refs]
        if dead:
            self.allocator.free(dead)

    def alloc_device(self, n_pages: int) -> list[int] | None:
        self._drop_orphans()
        return self.allocator.alloc(n_pages)

    def free_device(self, pages: Sequence[int]) -> None:
        self.allocator.free(pages)

    def evictable_device_tokens(self) -> int:
        return sum(self._refs.get(p) == 0 for p in self._orphans) * self.page_size

    def held_pages(self) -> int:
        """Pages handed over by `insert` and not freed yet (locked, or orphans)."""
        return len(self._refs)

    def poll(self) -> int:
        self._drop_orphans()
        return 0

    def wait_progress(self, timeout: float) -> bool:
        return False  # no background transfers

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        pass  # nothing is ever loaded

    def flush(self, timeout: float | None = None) -> None:
        self._drop_orphans()

    def reset(self) -> None:
        self._drop_orphans()

    def usage(self) -> dict[str, int]:
        return {
            "page_size": self.page_size,
            "device_pages_total": self.allocator.num_pages,
            "device_pages_free": self.allocator.num_free,
        }

    def storage_stats(self) -> BackendStats | None:
        return None

    def close(self) -> None:
        self._drop_orphans()
