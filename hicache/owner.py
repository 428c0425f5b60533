"""`CacheOwner`: what the parts of a `HiRadixCache` (prefetch, acks, integrity checks) see of it.

The parts live in their own modules and take the cache as a `CacheOwner`, so none of them imports
`hicache.hiradix` (no import circle); `HiRadixCache` satisfies the protocol structurally.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from hicache.config import HiCacheConfig
    from hicache.controller import TransferController
    from hicache.emit import Emitter
    from hicache.eviction import Candidates
    from hicache.keychain import KeyChain
    from hicache.pools import PageAllocator
    from hicache.radix import RadixTree, TreeNode
    from hicache.stats import CacheStats


class CacheOwner(Protocol):
    config: HiCacheConfig
    page_size: int
    tree: RadixTree
    chain: KeyChain
    controller: TransferController
    counters: CacheStats  # the live counters (`HiRadixCache.stats` is a snapshot)
    device_alloc: PageAllocator
    host_alloc: PageAllocator
    # Host pages owned by in-flight operations rather than by tree nodes, by id(op).
    host_inflight: dict[int, list[int]]
    device_candidates: Candidates
    host_candidates: Candidates
    events: Emitter

    @property
    def has_storage(self) -> bool: ...

    def set_host(self, node: TreeNode, pages: list[int] | None) -> None:
        """Set or clear `node`'s host copy (reported to the event sink)."""
        ...

    def admit(self, node: TreeNode) -> bool:
        """Whether `node`'s backed-up pages go on to L3 (`hicache.admission`)."""
        ...

    def alloc_host(self, n: int) -> list[int] | None:
        """`n` host pages, evicting host copies as needed; None when impossible."""
        ...

    def unpinned(self, nodes: list[TreeNode]) -> None:
        """Nodes whose lock or host pin reached zero: they may be eviction candidates now."""
        ...
