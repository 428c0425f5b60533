"""`Emitter`: turns tree changes into `hicache.events` for the cache's `EventSink`.

The cache calls it exactly where pages become present or absent on a tier. With no sink set,
every call is a no-op (no digest is computed); with a sink, the pages' block hashes come from
their chained digests (`KeyChain`), computed even when no storage backend is attached.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hicache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventSink, Tier, block_hash

if TYPE_CHECKING:
    from hicache.keychain import KeyChain
    from hicache.radix import TreeNode


class StoredRun:
    """What a `BlockStored` for pages that may leave the tree before their event needs:
    captured when a backup is submitted, emitted when it is acked."""

    __slots__ = ("hashes", "parent_hash", "tokens", "extra_key")

    def __init__(
        self, hashes: tuple[int, ...], parent_hash: int | None, tokens: tuple[int, ...],
        extra_key: str | None,
    ) -> None:
        self.hashes = hashes
        self.parent_hash = parent_hash
        self.tokens = tokens
        self.extra_key = extra_key


class Emitter:
    def __init__(self, chain: KeyChain, page_size: int) -> None:
        self.chain = chain
        self.page_size = page_size
        self.sink: EventSink | None = None

    @property
    def active(self) -> bool:
        return self.sink is not None

    def hashes(self, node: TreeNode) -> tuple[int, ...]:
        return tuple(block_hash(d) for d in self.chain.digests(node))

    def _parent_hash(self, node: TreeNode) -> int | None:
        p = node.parent
        if p is None or p.parent is None:
            return None
        return block_hash(self.chain.last_digest(p))

    def run(self, node: TreeNode) -> StoredRun:
        return StoredRun(self.hashes(node), self._parent_hash(node), node.key, node.extra_key)

    def stored(self, node: TreeNode, tier: Tier) -> None:
        if self.sink is not None:
            self.stored_run(self.run(node), tier)

    def stored_run(self, run: StoredRun, tier: Tier) -> None:
        if self.sink is not None and run.hashes:
            self.sink(BlockStored(run.hashes, run.parent_hash, run.tokens, self.page_size, tier,
                                  run.extra_key))

    def removed(self, node: TreeNode, tier: Tier) -> None:
        if self.sink is not None:
            self.sink(BlockRemoved(self.hashes(node), tier))

    def removed_keys(self, keys: Sequence[str], tier: Tier) -> None:
        if self.sink is not None and keys:
            self.sink(BlockRemoved(tuple(block_hash(bytes.fromhex(k)) for k in keys), tier))

    def cleared(self, tier: Tier | None) -> None:
        if self.sink is not None:
            self.sink(AllBlocksCleared(tier))
