"""`host_memory_mode="buffer_only"`: host memory as a staging buffer in front of L3.

A host copy then lives only while pages move: device -> host -> L3 (dropped when the backup is
acked) and L3 -> host -> device (dropped when loaded back, or when the request that fetched it
did not load it). A node left on no tier leaves the tree: its pages are in L3. `trim` is the one
place that drops them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.owner import CacheOwner
    from hicache.radix import TreeNode


def trim(c: CacheOwner, nodes: list[TreeNode]) -> None:
    """Drop the host copies of `nodes` (deepest first) that nothing pins; a node then on no tier
    leaves the tree with its host-only descendants."""
    for x in nodes:
        if x.removed or x.host_value is None or x.host_ref > 0:
            continue
        if x.value is None:
            _remove_host_only(c, x)
            continue
        c.host_alloc.free(x.host_value)
        c.set_host(x, None)


def trim_path(c: CacheOwner, node: TreeNode) -> None:
    """In buffer_only mode, after a pin on `node`'s path went away: drop the staged copies on
    that path whose pages are in L3."""
    if c.config.host_memory_mode == "buffer_only" and not node.removed:
        trim(c, [x for x in c.tree.path(node) if x.stored])


def _remove_host_only(c: CacheOwner, node: TreeNode) -> None:
    """Remove host-only `node` and its (host-only, unpinned) subtree."""
    order: list[TreeNode] = []
    stack = [node]
    while stack:
        x = stack.pop()
        order.append(x)
        stack.extend(x.children.values())
    parent = node.parent
    for x in reversed(order):
        assert x.host_value is not None and x.value is None
        c.host_alloc.free(x.host_value)
        c.set_host(x, None)
        c.tree.remove_leaf(x)
    if parent is not None:
        c.device_candidates.push(parent)
        c.host_candidates.push(parent)
