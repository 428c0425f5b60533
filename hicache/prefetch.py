"""The storage -> host prefetch state machine of a `HiRadixCache`.

A request's prefetch goes: *started* (`start`: host pages reserved, the worker reads L3 in
batches) -> *taken* (`take`, at admission: the pages fetched so far become host-only nodes) or
*cancelled* (`cancel`: the request went away) -> *released* (`released`, once the worker is done
too: the reserved host pages no node took are freed). `ready` applies the prefetch policy.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from hicache.controller import PrefetchOp
from hicache.keys import page_keys
from hicache.radix import Tokens, common_pages

if TYPE_CHECKING:
    from hicache.owner import CacheOwner

logger = logging.getLogger(__name__)


class Prefetcher:
    def __init__(self, owner: CacheOwner) -> None:
        self.c = owner
        self.pending: dict[str, PrefetchOp] = {}  # by request id, until taken or cancelled

    def __len__(self) -> int:
        return len(self.pending)

    def start(self, rid: str, t: Tokens, extra_key: str | None) -> int:
        """Start fetching the pages of `t` beyond what the tree holds; return the tokens it
        will fetch (0: not started)."""
        c = self.c
        ps = c.page_size
        cfg = c.config
        if not c.has_storage or rid in self.pending:
            return 0
        nodes = c.tree.match_split(t, extra_key)
        matched = sum(x.num_pages for x in nodes)
        remaining = len(t) // ps - matched
        if remaining <= 0 or remaining * ps < cfg.prefetch_threshold:
            c.counters.prefetch_skipped += 1
            return 0
        anchor = nodes[-1] if nodes else c.tree.root(extra_key)
        prior = c.chain.last_digest(anchor)
        digests = page_keys(t[matched * ps : (matched + remaining) * ps], ps, prior)
        keys = [d.hex() for d in digests]
        n = c.controller.exists(keys)
        if n * ps < cfg.prefetch_threshold or n == 0:
            c.counters.prefetch_skipped += 1
            return 0
        c.tree.inc_lock(anchor)
        host = c.alloc_host(n)
        if host is None:
            c.unpinned(c.tree.dec_lock(anchor))
            c.counters.prefetch_skipped += 1
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
        self.pending[rid] = op
        c.host_inflight[id(op)] = host
        c.counters.prefetch_started += 1
        c.controller.submit_prefetch(op)
        return n * ps

    def ready(self, rid: str) -> bool:
        """Whether the prefetch policy lets request `rid` be scheduled now."""
        op = self.pending.get(rid)
        if op is None or op.done.is_set():
            return True
        policy = self.c.config.prefetch_policy
        if policy == "best_effort":
            return True
        if policy == "wait_complete":
            return False
        return time.monotonic() - op.started >= op.budget_s

    def progress(self, rid: str) -> tuple[int, int]:
        """(pages fetched so far, pages asked) of a pending prefetch; (0, 0) when none."""
        op = self.pending.get(rid)
        return (op.completed, len(op.keys)) if op else (0, 0)

    def cancel(self, rid: str) -> None:
        """Drop the prefetch of a request that went away; its host pages are given back as soon
        as the worker has stopped touching them."""
        op = self.pending.pop(rid, None)
        if op is None:
            return
        op.cancelled = True
        op.stop.set()
        self.c.unpinned(self.c.tree.dec_lock(op.anchor))
        if op.done.is_set():
            self.released(op)

    def cancel_all(self) -> None:
        for rid in list(self.pending):
            self.cancel(rid)

    def take(self, rid: str) -> int:
        """At admission: insert the pages fetched so far as host-only nodes; return the tokens
        that became new in the tree (0 with no prefetch)."""
        op = self.pending.pop(rid, None)
        if op is None:
            return 0
        c = self.c
        take = op.completed
        op.stop.set()
        op.taken = take
        new_tokens, dups = self._insert_host_pages(op, take)
        if dups:
            c.host_alloc.free(dups)
            c.counters.prefetch_revoked_pages += len(dups)
        c.host_inflight[id(op)] = op.host_pages[take:]
        c.unpinned(c.tree.dec_lock(op.anchor))
        if op.done.is_set():
            self.released(op)
        return new_tokens

    def _insert_host_pages(self, op: PrefetchOp, take: int) -> tuple[int, list[int]]:
        c = self.c
        ps = c.page_size
        t = op.tokens
        node = op.anchor
        base = op.start_page
        dups: list[int] = []
        j = 0
        while j < take:
            lo = (base + j) * ps
            child = node.children.get(t[lo : lo + ps])
            if child is None:
                child = c.tree.new_child(node, t[lo : (base + take) * ps])
                child.host_value = op.host_pages[j:take]
                child.page_keys = [bytes.fromhex(k) for k in op.keys[j:take]]
                c.events.stored(child, "host")
                c.host_candidates.push(child)
                return (take - j) * ps, dups
            m = common_pages(child.key, t[lo : (base + take) * ps], ps)
            if m < child.num_pages:
                child = c.tree.split(child, m)
            if child.host_value is None:
                child.host_value = op.host_pages[j : j + m]  # a device-only node gains a copy
                c.events.stored(child, "host")
            else:
                dups.extend(op.host_pages[j : j + m])
            node = child
            j += m
        return 0, dups

    def released(self, op: PrefetchOp) -> None:
        """Free the host pages of `op` that no node took. Once, after the worker is done."""
        if op.released:
            return
        op.released = True
        c = self.c
        left = c.host_inflight.pop(id(op), [])
        if left:
            c.host_alloc.free(left)
        c.counters.prefetch_revoked_pages += max(0, op.completed - (op.taken or 0))
