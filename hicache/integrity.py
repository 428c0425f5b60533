"""Occupancy and invariant checks of a `HiRadixCache` (`usage`, `check_integrity`).

Invariants:
- every non-root node has device pages or host pages, one per page of its key;
- device residency is prefix-closed: a node on the device has its parent on the device;
- a page id is owned by exactly one node (or one in-flight transfer), and is allocated;
- host pages = tree host pages + pages held by in-flight transfers + free pages;
- pins are path-wide: a node's `lock_ref` / `host_ref` >= the sum of its children's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from hicache.owner import CacheOwner
    from hicache.pools import PageAllocator
    from hicache.radix import TreeNode


def usage(c: CacheOwner, pending_prefetches: int) -> dict[str, int]:
    """Pool and tree occupancy, in pages and tokens, and transfer health."""
    ps = c.page_size
    dev = host = evictable = 0
    for x in c.tree.nodes():
        if x.value is not None:
            dev += len(x.value)
            if x.lock_ref == 0:
                evictable += len(x.value)
        if x.host_value is not None:
            host += len(x.host_value)
    return {
        "page_size": ps,
        "device_pages_total": c.device_alloc.num_pages,
        "device_pages_free": c.device_alloc.num_free,
        "device_cached_tokens": dev * ps,
        "device_evictable_tokens": evictable * ps,
        "host_pages_total": c.host_alloc.num_pages,
        "host_pages_free": c.host_alloc.num_free,
        "host_cached_tokens": host * ps,
        "host_inflight_pages": sum(len(v) for v in c.host_inflight.values()),
        "pending_prefetches": pending_prefetches,
        "pending_transfers": c.controller.pending,
        # Health: background transfer threads alive (3 unless synchronous), L3 backing off.
        "transfer_threads_alive": c.controller.threads_alive,
        "storage_down": int(c.controller.storage_down),
    }


def _check_pages(
    x: TreeNode, tier: str, pages: Sequence[int], n: int, alloc: PageAllocator, seen: set[int]
) -> None:
    """Node `x` holds one `tier` page per key page; each is allocated and owned by `x` alone
    (`seen`: the pages of the nodes checked so far, `x`'s are added)."""
    assert len(pages) == n, f"{x}: {len(pages)} {tier} pages for {n} pages"
    for pg in pages:
        assert pg not in seen, f"{tier} page {pg} owned twice"
        assert alloc.is_used(pg), f"{tier} page {pg} in tree but free"
        seen.add(pg)


def _check_node(c: CacheOwner, x: TreeNode, dev_seen: set[int], host_seen: set[int]) -> None:
    ps = c.page_size
    p = x.parent
    assert p is not None and not x.removed, f"{x} detached but reachable"
    assert p.children.get(x.key[:ps]) is x, f"{x} not under its parent's key"
    assert x.key and len(x.key) % ps == 0, f"{x} key of {len(x.key)} tokens"
    n = len(x.key) // ps
    assert x.value is not None or x.host_value is not None, f"{x} on no tier"
    if x.value is not None:
        assert p.value is not None, f"{x} on device under a node that is not"
        _check_pages(x, "device", x.value, n, c.device_alloc, dev_seen)
    if x.host_value is not None:
        _check_pages(x, "host", x.host_value, n, c.host_alloc, host_seen)
    if x.page_keys is not None:
        assert len(x.page_keys) == n, f"{x}: {len(x.page_keys)} keys for {n} pages"
    dc = sum(ch.value is not None for ch in x.children.values())
    assert x.device_children == dc, f"{x}: device_children {x.device_children} != {dc}"
    child_locks = sum(ch.lock_ref for ch in x.children.values())
    assert x.lock_ref >= child_locks, f"{x}: lock_ref {x.lock_ref} < children's {child_locks}"
    assert x.host_ref >= sum(ch.host_ref for ch in x.children.values()), (
        f"{x}: host_ref below its children's"
    )
    assert x.lock_ref >= 0 and x.host_ref >= 0, f"{x}: negative pin"


def check_integrity(c: CacheOwner, outside_device_pages: int | None = None) -> None:
    """Raise AssertionError, with the numbers, when any invariant is broken.

    `outside_device_pages`: device pages the caller holds outside the tree (running requests);
    when given, tree pages + outside + free must equal the pool.
    """
    dev_seen: set[int] = set()
    host_seen: set[int] = set()
    for r in c.tree.roots.values():
        assert r.value == [] and r.host_value == [], "root holds pages"
        dc = sum(ch.value is not None for ch in r.children.values())
        assert r.device_children == dc, f"root: device_children {r.device_children} != {dc}"
    for x in c.tree.nodes():
        _check_node(c, x, dev_seen, host_seen)
    locked = sum(len(x.value) for x in c.tree.nodes() if x.value is not None and x.lock_ref)
    assert c.tree.device_pages == len(dev_seen), (
        f"tree counts {c.tree.device_pages} device pages, holds {len(dev_seen)}"
    )
    assert c.tree.locked_device_pages == locked, (
        f"tree counts {c.tree.locked_device_pages} locked device pages, holds {locked}"
    )
    inflight: set[int] = set()
    for pages in c.host_inflight.values():
        for pg in pages:
            assert pg not in host_seen and pg not in inflight, f"host page {pg} owned twice"
            assert c.host_alloc.is_used(pg), f"in-flight host page {pg} is free"
            inflight.add(pg)
    used_host = c.host_alloc.num_used
    assert used_host == len(host_seen) + len(inflight), (
        f"host pool: used {used_host} != tree {len(host_seen)} + in-flight {len(inflight)}"
    )
    assert not (dev_seen & c.device_alloc.free_pages()), "tree device page is free"
    if outside_device_pages is not None:
        used = c.device_alloc.num_used
        assert used == len(dev_seen) + outside_device_pages, (
            f"device pool: used {used} != tree {len(dev_seen)} + outside {outside_device_pages}"
        )


def state_digest(c: CacheOwner, pending: int = 0) -> list[int]:
    """What must be equal on every tensor-parallel rank, as a few 62-bit numbers: the tree
    (every node's id, parent, tokens, device and host pages, pins, L3 flag, use count and access
    time, parents before children), its clock, the free page counts, and `pending` (pending
    prefetches). `hicache.sync.RankSync.check` compares them across ranks."""
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    for x in c.tree.nodes():
        parent = x.parent.id if x.parent is not None else 0
        h.update(repr((x.id, parent, x.key, x.value, x.host_value, x.lock_ref, x.host_ref,
                       x.stored, x.hit_count, x.last_access)).encode())
    tree = int.from_bytes(h.digest(), "little") >> 2
    return [tree, c.tree.tick, c.device_alloc.num_free, c.host_alloc.num_free, pending]
