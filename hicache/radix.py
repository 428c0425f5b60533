"""A page-granular radix tree of token sequences.

Every edge key is a whole number of pages (`page_size` tokens each); a node is split only on a
page boundary. One root per `extra_key` keeps tenants (or LoRA adapters, or `cache_salt`s) apart:
a sequence under one extra_key never matches another's. The tree knows nothing of tiers beyond
the per-node fields; `HiRadixCache` gives them meaning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import count
from typing import NamedTuple

Tokens = tuple[int, ...]


class TreeNode:
    """One edge of the tree and the pages that hold its KV.

    - `key`: the edge's tokens (a whole number of pages); empty for a root.
    - `value`: device page ids, one per page of `key`, or None when not on the device.
    - `host_value`: host page ids, or None when not in host memory.
    - `page_keys`: storage digests, one per page (computed lazily, only with an L3 backend).
    - `lock_ref`: pins the device copy; taken along the whole path to the root, so a node's
      count is at least the sum of its children's.
    - `host_ref`: pins the host copy while a transfer reads it; also path-wide.
    - `hit_count`, `last_access` (logical clock), `created`, `priority`: eviction inputs.
    - `stored`: the pages are known to be in L3 (this cache's backup of them was acked, or they
      were read from it); used to skip re-staging them through host memory.
    - `no_write`: computed by a request that asked `skip_cache_write`: never copied below the
      device, evicted first (cleared when a request without the hint uses the pages).
    - `retain_until`: a soft pin (`retention_seconds`) until this time of the cache's clock; 0:
      none. Evicted only when nothing unpinned is left.
    - `declined`: L3 admission declined the pages' write; asked again when they are hit.
    """

    __slots__ = (
        "id",
        "key",
        "children",
        "parent",
        "value",
        "host_value",
        "page_keys",
        "lock_ref",
        "host_ref",
        "hit_count",
        "last_access",
        "created",
        "priority",
        "removed",
        "extra_key",
        "device_children",
        "stored",
        "no_write",
        "retain_until",
        "declined",
    )

    def __init__(self, node_id: int, key: Tokens, parent: TreeNode | None, tick: int) -> None:
        self.id = node_id
        self.key = key
        self.children: dict[Tokens, TreeNode] = {}
        self.parent = parent
        self.value: list[int] | None = None
        self.host_value: list[int] | None = None
        self.page_keys: list[bytes] | None = None
        self.lock_ref = 0
        self.host_ref = 0
        self.hit_count = 0
        self.last_access = tick
        self.created = tick
        self.priority = 0
        self.removed = False
        self.device_children = 0  # children with a device copy (kept by RadixTree.set_value)
        self.stored = False  # pages known to be in L3 (a backup acked, or read from it)
        self.no_write = False  # skip_cache_write: never below the device
        self.retain_until = 0.0  # soft pin's end (the cache's clock); 0: none
        self.declined = False  # L3 admission declined the write (asked again on a hit)
        self.extra_key: str | None = parent.extra_key if parent is not None else None

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def on_device(self) -> bool:
        return self.value is not None

    @property
    def on_host(self) -> bool:
        return self.host_value is not None

    @property
    def num_pages(self) -> int:
        ps_pages = self.value if self.value is not None else self.host_value
        return len(ps_pages) if ps_pages is not None else 0

    def has_device_child(self) -> bool:
        return self.device_children > 0

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, tokens={len(self.key)}, device={self.value is not None}, "
            f"host={self.host_value is not None}, lock={self.lock_ref}, host_ref={self.host_ref})"
        )


class PathMatch(NamedTuple):
    nodes: list[TreeNode]  # fully matched nodes, root excluded, top-down
    matched_tokens: int  # tokens of `nodes` plus `partial_pages` pages of `partial`
    partial: TreeNode | None  # node matched only in part (its first `partial_pages` pages)
    partial_pages: int


class RadixTree:
    """The structure: roots per extra_key, match, split, add and remove, path-wide refcounts."""

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self._ids = count(1)
        self.roots: dict[str | None, TreeNode] = {}
        self.tick = 0
        # Device pages held by nodes, and those of them under a lock (kept exact by set_value,
        # inc_lock, dec_lock and remove_leaf), so "evictable" is O(1).
        self.device_pages = 0
        self.locked_device_pages = 0
        # Called with (upper, lower) after every split (the cache keeps its soft pins by node).
        self.on_split: Callable[[TreeNode, TreeNode], None] | None = None

    # -- roots and nodes ---------------------------------------------------------------------

    def root(self, extra_key: str | None) -> TreeNode:
        key = extra_key or None
        r = self.roots.get(key)
        if r is None:
            r = TreeNode(0, (), None, self.tick)
            r.extra_key = key
            r.value = []
            r.host_value = []
            self.roots[key] = r
        return r

    def clock(self) -> int:
        self.tick += 1
        return self.tick

    def new_child(self, parent: TreeNode, key: Tokens) -> TreeNode:
        """Attach a fresh node under `parent` (no pages yet: the caller sets them)."""
        ps = self.page_size
        if not key or len(key) % ps:
            raise ValueError(f"key of {len(key)} tokens is not a whole number of pages")
        first = key[:ps]
        if first in parent.children:
            raise ValueError("parent already has a child starting with this page")
        node = TreeNode(next(self._ids), key, parent, self.tick)
        parent.children[first] = node
        return node

    def set_value(self, node: TreeNode, pages: list[int] | None) -> None:
        """Set (or clear, with None) the device pages of `node`, keeping its parent's count of
        device children and the tree's page counts exact. Every change of `TreeNode.value`
        goes through here."""
        parent = node.parent
        if parent is not None:
            parent.device_children += (pages is not None) - (node.value is not None)
        delta = (len(pages) if pages is not None else 0) - (
            len(node.value) if node.value is not None else 0
        )
        self.device_pages += delta
        if node.lock_ref > 0:
            self.locked_device_pages += delta
        node.value = pages

    def remove_leaf(self, node: TreeNode) -> None:
        if node.children:
            raise ValueError(f"{node} has children")
        parent = node.parent
        if parent is None:
            raise ValueError("cannot remove a root")
        if node.value is not None:
            parent.device_children -= 1
            self.device_pages -= len(node.value)
            if node.lock_ref > 0:
                self.locked_device_pages -= len(node.value)
        del parent.children[node.key[: self.page_size]]
        node.removed = True
        node.parent = None

    def split(self, node: TreeNode, n_pages: int) -> TreeNode:
        """Split `node` after its first `n_pages` pages; return the new upper node.

        The upper node inherits the pins (`lock_ref`, `host_ref`) of `node`: pins are path-wide,
        so every pin that covers `node` covers its new parent too, and releasing it through
        `node` walks through the new parent.
        """
        ps = self.page_size
        cut = n_pages * ps
        if not 0 < cut < len(node.key):
            raise ValueError(f"split at page {n_pages} of a {len(node.key) // ps}-page node")
        parent = node.parent
        assert parent is not None
        upper = TreeNode(next(self._ids), node.key[:cut], parent, node.last_access)
        upper.created = node.created
        upper.hit_count = node.hit_count
        upper.priority = node.priority
        upper.lock_ref = node.lock_ref
        upper.host_ref = node.host_ref
        upper.stored = node.stored
        upper.no_write = node.no_write
        upper.retain_until = node.retain_until
        upper.declined = node.declined
        if node.value is not None:
            upper.value, node.value = node.value[:n_pages], node.value[n_pages:]
            upper.device_children = 1  # `node`, its only child; the parent's count is unchanged
        if node.host_value is not None:
            upper.host_value, node.host_value = node.host_value[:n_pages], node.host_value[n_pages:]
        if node.page_keys is not None:
            upper.page_keys, node.page_keys = node.page_keys[:n_pages], node.page_keys[n_pages:]
        node.key = node.key[cut:]
        parent.children[upper.key[:ps]] = upper
        upper.children[node.key[:ps]] = node
        node.parent = upper
        if self.on_split is not None:
            self.on_split(upper, node)
        return upper

    # -- matching ------------------------------------------------------------------------------

    def match(self, tokens: Tokens, extra_key: str | None = None) -> PathMatch:
        """Walk the longest page-aligned prefix of `tokens` present in the tree."""
        ps = self.page_size
        n = len(tokens) // ps * ps
        node = self.root(extra_key)
        nodes: list[TreeNode] = []
        i = 0
        while i < n:
            child = node.children.get(tokens[i : i + ps])
            if child is None:
                break
            k = child.key
            if len(k) <= n - i and k == tokens[i : i + len(k)]:
                nodes.append(child)
                i += len(k)
                node = child
                continue
            # Partial: count matching pages (the first one matched by the dict lookup).
            pages = 1
            limit = min(len(k), n - i) // ps
            while pages < limit and k[pages * ps : (pages + 1) * ps] == tokens[
                i + pages * ps : i + (pages + 1) * ps
            ]:
                pages += 1
            if pages * ps == len(k):  # whole node matched after all
                nodes.append(child)
                i += len(k)
                node = child
                continue
            return PathMatch(nodes, i + pages * ps, child, pages)
        return PathMatch(nodes, i, None, 0)

    def match_split(self, tokens: Tokens, extra_key: str | None = None) -> list[TreeNode]:
        """Like `match`, but split a partially matched node so the path ends exactly at the
        match. Returns the matched nodes, top-down (root excluded)."""
        m = self.match(tokens, extra_key)
        if m.partial is None:
            return m.nodes
        return [*m.nodes, self.split(m.partial, m.partial_pages)]

    # -- path-wide pins ---------------------------------------------------------------------

    @staticmethod
    def path(node: TreeNode) -> Iterator[TreeNode]:
        """`node` and its ancestors up to (excluding) the root."""
        x: TreeNode | None = node
        while x is not None and x.parent is not None:
            yield x
            x = x.parent

    def inc_lock(self, node: TreeNode) -> None:
        for x in self.path(node):
            if x.lock_ref == 0 and x.value is not None:
                self.locked_device_pages += len(x.value)
            x.lock_ref += 1

    def dec_lock(self, node: TreeNode) -> list[TreeNode]:
        """Release one lock; return the nodes whose count reached zero."""
        return self._dec_ref(node, "lock_ref", self._unlocked)

    def _unlocked(self, x: TreeNode) -> None:
        if x.value is not None:
            self.locked_device_pages -= len(x.value)

    def inc_host_ref(self, node: TreeNode) -> None:
        for x in self.path(node):
            x.host_ref += 1

    def dec_host_ref(self, node: TreeNode) -> list[TreeNode]:
        """Release one host pin; return the nodes whose count reached zero."""
        return self._dec_ref(node, "host_ref")

    def _dec_ref(
        self, node: TreeNode, ref: str, on_zero: Callable[[TreeNode], None] | None = None
    ) -> list[TreeNode]:
        """Decrement counter `ref` along the path from `node` to the root, calling `on_zero` on
        each node whose count reaches zero; those nodes. Underflow raises at the node where it
        happens (the nodes below it stay decremented)."""
        freed = []
        for x in self.path(node):
            n = getattr(x, ref)
            if n <= 0:
                raise RuntimeError(f"{ref} underflow on {x}")
            setattr(x, ref, n - 1)
            if n == 1:
                freed.append(x)
                if on_zero is not None:
                    on_zero(x)
        return freed

    # -- iteration ---------------------------------------------------------------------------

    def nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, parents before children."""
        stack = list(self.roots.values())
        while stack:
            x = stack.pop()
            if x.parent is not None:
                yield x
            stack.extend(x.children.values())

    def prefix_tokens(self, node: TreeNode) -> int:
        """Tokens from the root to the end of `node`."""
        return sum(len(x.key) for x in self.path(node))

    def clear(self) -> None:
        for r in self.roots.values():
            for x in list(r.children.values()):
                x.parent = None
        self.roots.clear()
        self.device_pages = self.locked_device_pages = 0


def common_pages(a: Sequence[int], b: Sequence[int], page_size: int) -> int:
    """Number of leading whole pages on which `a` and `b` agree."""
    n = min(len(a), len(b)) // page_size
    for p in range(n):
        if a[p * page_size : (p + 1) * page_size] != b[p * page_size : (p + 1) * page_size]:
            return p
    return n
