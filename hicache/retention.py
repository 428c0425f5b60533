"""`Keeper`: what of the tree is written to L3 and how long it stays, applied on the owner's thread.

It holds the cache's L3 admission policy and its sketch of declined pages
(`hicache.admission`), and the soft pins of `retention_seconds` in expiry order. `HiRadixCache`
calls it where pages are computed (`computed`), hit (`reused`), backed up (`admit`), inserted
with a retention hint (`retain`), and before every decision that depends on pins (`expire`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from itertools import count
from typing import TYPE_CHECKING

from hicache.admission import Declined, make_admission

if TYPE_CHECKING:
    from hicache.acks import Acks
    from hicache.owner import CacheOwner
    from hicache.radix import TreeNode


class Keeper:
    def __init__(self, owner: CacheOwner, acks: Acks, clock: Callable[[], float]) -> None:
        self.c = owner
        self.acks = acks
        self.clock = clock
        self.admission = make_admission(owner.config.storage_admission)
        self.declined = Declined()
        self.pins: list[tuple[float, int, TreeNode]] = []  # (retain_until, seq, node)
        self._seq = count()
        owner.tree.on_split = self._split

    def clear(self) -> None:
        self.pins.clear()

    # -- admission ---------------------------------------------------------------------------

    def admit(self, node: TreeNode) -> bool:
        """Whether `node`'s pages go to L3 now (False without L3, or for skip_cache_write
        pages). A refusal by admission marks the node `declined` (asked again when it is hit),
        counts its pages and puts them in the declined sketch."""
        c = self.c
        if not c.has_storage or node.no_write:
            return False
        if not self.admission.counts_uses:
            return True
        digests = c.chain.digests(node)
        if self.admission.admits(digests):
            if node.declined:
                node.declined = False
                self.declined.discard(digests)
            return True
        node.declined = True
        c.counters.storage_declined_pages += len(digests)
        self.declined.add(digests)
        return False

    def computed(self, fresh: list[TreeNode]) -> None:
        """A request computed these nodes' pages: their first use (or one more, for pages that
        had left the tree), and recomputed declined pages L3 would have served."""
        c = self.c
        if not fresh or not c.has_storage or not self.admission.counts_uses:
            return
        for x in fresh:
            d = c.chain.digests(x)
            self.admission.seen(d)
            if x.host_value is None:  # recomputed for want of a copy (not a host copy's plan)
                c.counters.storage_declined_rehit_pages += self.declined.count(d)

    def reused(self, used: list[TreeNode]) -> None:
        """A request hit these nodes on device/host (top-down): count the use, and write the
        ones admission declined before and admits now (their host copy is complete)."""
        c = self.c
        if not used or not c.has_storage or not self.admission.counts_uses:
            return
        for x in used:
            self.admission.seen(c.chain.digests(x))
        for x in used:
            if x.declined and x.host_value is not None and not x.stored and self.admit(x):
                self.acks.backup(x, list(x.host_value), c.chain.storage_keys(x))

    # -- soft pins ---------------------------------------------------------------------------

    def retain(self, node: TreeNode, seconds: float) -> float:
        """Soft-pin `node` and its ancestors for `seconds` (cut to `max_retention_seconds`);
        an existing longer pin stays. Returns the pin's end on the cache's clock (0: none)."""
        c = self.c
        limit = c.config.max_retention_seconds
        if seconds <= 0 or limit <= 0:
            return 0.0
        st = c.counters
        st.retention_requests += 1
        if seconds > limit:
            st.retention_clamped += 1
            seconds = limit
        until = self.clock() + seconds
        for x in c.tree.path(node):
            if x.retain_until < until:
                x.retain_until = until
                heapq.heappush(self.pins, (until, next(self._seq), x))
                c.unpinned([x])  # its eviction class changed: a candidate again, re-keyed
        return until

    def _split(self, upper: TreeNode, lower: TreeNode) -> None:
        if upper.retain_until:  # the upper part keeps the pin, and ends with it
            heapq.heappush(self.pins, (upper.retain_until, next(self._seq), upper))

    def expire(self) -> None:
        """End the soft pins whose time has come (counted), so eviction may take them."""
        pins = self.pins
        if not pins:
            return
        now = self.clock()
        while pins and pins[0][0] <= now:
            until, _, x = heapq.heappop(pins)
            if x.retain_until == until and not x.removed:
                x.retain_until = 0.0
                self.c.counters.retention_expired += 1
                self.c.unpinned([x])
