"""Eviction policies, chosen by name through a registry.

A policy orders evictable nodes by a sort key: the smallest key is evicted first. Every key ends
with `(last_access, node_id)`, so ties fall back to LRU and the order is total and deterministic.
Access times are a logical clock (`TreeNode.last_access`), not wall time.

Before the policy's key comes a node's class (`hint_class`), whatever the policy: pages of a
`skip_cache_write` request go first, soft-pinned ones (`retention_seconds`) last.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from itertools import count
from typing import TYPE_CHECKING, Any, ClassVar

from hicache_client.errors import ConfigError

if TYPE_CHECKING:
    from hicache.radix import TreeNode

SortKey = tuple[int, ...]


class EvictionPolicy(ABC):
    name: ClassVar[str]
    # Config keys this policy accepts; anything else is a start-up error.
    config_keys: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        config = dict(config or {})
        unknown = set(config) - self.config_keys
        if unknown:
            allowed = ", ".join(sorted(self.config_keys)) or "none"
            raise ConfigError(
                f"unknown {self.name} eviction config keys {sorted(unknown)}; allowed: {allowed}"
            )
        self.config = config

    @abstractmethod
    def key(self, node: TreeNode) -> SortKey:
        """Sort key of an evictable node; smallest goes first."""


class LRU(EvictionPolicy):
    name = "lru"

    def key(self, node: TreeNode) -> SortKey:
        return (node.last_access, node.id)


class MRU(EvictionPolicy):
    name = "mru"

    def key(self, node: TreeNode) -> SortKey:
        return (-node.last_access, node.id)


class FIFO(EvictionPolicy):
    name = "fifo"

    def key(self, node: TreeNode) -> SortKey:
        return (node.created, node.last_access, node.id)


class LFU(EvictionPolicy):
    name = "lfu"

    def key(self, node: TreeNode) -> SortKey:
        return (node.hit_count, node.last_access, node.id)


class Priority(EvictionPolicy):
    """Lowest `TreeNode.priority` first (set by the caller, e.g. a request's priority)."""

    name = "priority"

    def key(self, node: TreeNode) -> SortKey:
        return (node.priority, node.last_access, node.id)


class SLRU(EvictionPolicy):
    """Segmented LRU: nodes hit fewer than `protected_threshold` times (probationary) go before
    any protected node; LRU within each segment."""

    name = "slru"
    config_keys = frozenset({"protected_threshold"})

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        t = self.config.get("protected_threshold", 2)
        if not isinstance(t, int) or isinstance(t, bool) or t < 1:
            raise ConfigError(f"slru protected_threshold must be an int >= 1, got {t!r}")
        self.protected_threshold = t

    def key(self, node: TreeNode) -> SortKey:
        protected = 1 if node.hit_count >= self.protected_threshold else 0
        return (protected, node.last_access, node.id)


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRU, LFU, SLRU, Priority, FIFO, MRU)
}


def register_policy(cls: type[EvictionPolicy]) -> None:
    EVICTION_POLICIES[cls.name] = cls


def make_policy(name: str, config: Mapping[str, Any] | None = None) -> EvictionPolicy:
    if name not in EVICTION_POLICIES:
        raise ConfigError(
            f"unknown eviction policy {name!r}; known: {', '.join(sorted(EVICTION_POLICIES))}"
        )
    return EVICTION_POLICIES[name](config)


def hint_class(node: TreeNode) -> int:
    """0: `skip_cache_write` pages; 1: the rest; 2: soft-pinned (evicted only when nothing
    else is left). The tree clears `retain_until` when a pin expires and pushes the node again."""
    if node.no_write:
        return 0
    return 2 if node.retain_until else 1


class Candidates:
    """Lazy min-heap of eviction candidates in policy order. Entries go stale when a node's key
    changes or it stops being a candidate; they are checked when popped. Push whenever a node may
    have become a candidate or its key may have changed."""

    def __init__(self, policy: EvictionPolicy, valid: Callable[[TreeNode], bool]) -> None:
        self.policy = policy
        self.valid = valid
        self.heap: list[tuple[SortKey, int, TreeNode]] = []
        self._seq = count()

    def key(self, node: TreeNode) -> SortKey:
        return (hint_class(node), *self.policy.key(node))

    def push(self, node: TreeNode) -> None:
        if node.parent is not None and self.valid(node):
            heapq.heappush(self.heap, (self.key(node), next(self._seq), node))

    def pop(self) -> TreeNode | None:
        while self.heap:
            key, _, node = heapq.heappop(self.heap)
            if self.valid(node) and self.key(node) == key:
                return node
        return None

    def rebuild(self, nodes: Sequence[TreeNode]) -> None:
        self.heap = [(self.key(n), next(self._seq), n) for n in nodes if self.valid(n)]
        heapq.heapify(self.heap)

    def clear(self) -> None:
        self.heap.clear()


def device_candidate(n: TreeNode) -> bool:
    """A device copy eviction may take: unlocked, with no child on the device."""
    return not n.removed and n.value is not None and n.lock_ref == 0 and n.device_children == 0


def host_candidate(n: TreeNode) -> bool:
    """A host copy eviction may take: a host-only leaf that nothing pins."""
    return (
        not n.removed
        and n.value is None
        and n.host_value is not None
        and not n.children
        and n.host_ref == 0
        and n.lock_ref == 0
    )
