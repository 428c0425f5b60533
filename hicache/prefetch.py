"""The storage -> host prefetch state machine of a `HiRadixCache`.

A request's prefetch goes through two operations on the controller's prefetch worker:

1. *probe* (`start`): the worker asks L3 which leading pages of the request's uncached tail it
   has (`batch_exists`, in batches). The owner's thread never waits on L3. The host copies of
   the matched prefix are pinned (`host_ref`); no device copy is.
2. *fetch* (`acked`, when the probe's ack is applied): host pages are reserved for exactly the
   pages L3 has (pending prefetches hold at most `prefetch_max_host_share` of the host pool),
   and the worker reads them in batches, stopping at the first missing or invalid page.

Then *taken* (`take`, at admission: the pages fetched so far become host-only nodes under the
end of their prefix, if the tree still holds it) or *cancelled* (`cancel`), and *released*
(`released`, once the worker is done too: the reserved pages no node took are freed). `ready`
applies the prefetch policy.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, TypeVar

from hicache.attribution import Note
from hicache.config import DEFAULT_PREFETCH_THRESHOLD
from hicache.ops import BackupOp, PrefetchOp, Transfer
from hicache.radix import Tokens, common_pages
from hicache.staging import trim_path
from hicache_client.keys import page_keys

if TYPE_CHECKING:
    from collections.abc import Sequence

    from hicache.owner import CacheOwner
    from hicache.radix import TreeNode
    from hicache.transfer import Event, LayerDoneCounter

logger = logging.getLogger(__name__)
V = TypeVar("V")

# With `prefetch_threshold` left unset, a gap shorter than DEFAULT_PREFETCH_THRESHOLD tokens is
# prefetched when the cost model expects loading it to save at least this many seconds over
# recomputing it. NOTE: every prefetch first asks L3 which pages it has, and the request waits for
# that answer (timeout and wait_complete policies) even when L3 has nothing: one round trip, 2-5 ms
# on loopback on the 2-core development machine. 50 ms keeps such a wasted probe under a tenth of
# the time a hit would save. Where prefill is fast (a GPU), 50 ms is far more than 256 tokens, so
# the floor of 256 decides, as in SGLang.
PREFETCH_MIN_SAVING_S = 0.05


def is_probe(op: PrefetchOp) -> bool:
    """A probe asks L3 and reads nothing: it has keys but no host pages."""
    return not op.host_pages


class Prefetcher:
    def __init__(self, owner: CacheOwner) -> None:
        self.c = owner
        self.pending: dict[str, PrefetchOp] = {}  # by request id, until taken or cancelled
        self.held = 0  # host pages owned by prefetches (pending, or taken and not yet released)
        # Miss attribution (hicache.attribution), by request id until its admission takes it:
        # what came of the pages its prefetch asked for (`Note`), the runs a fetch left out, and
        # why L3 was not asked at all.
        self.notes: dict[str, Note] = {}
        self.tails: dict[str, list[tuple[int, str | None]]] = {}
        self.unprobed: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self.pending)

    def start(self, rid: str, t: Tokens, extra_key: str | None) -> int:
        """Probe L3 for the pages of `t` beyond what the tree holds. Returns the tokens asked
        (0: not started: no L3 or L3 backing off, too short (`worth_prefetching`), or the host
        share is used up)."""
        c = self.c
        ps = c.page_size
        cfg = c.config
        if not c.has_storage or rid in self.pending:
            return 0
        nodes = c.tree.match_split(t, extra_key)
        matched = sum(x.num_pages for x in nodes)
        n = min(len(t) // ps - matched, self._allowance())
        if not self.worth_prefetching(n * ps) or not c.controller.storage_usable():
            c.counters.prefetch_skipped += 1
            why = ("storage_unavailable" if not c.controller.storage_usable()
                   else "below_prefetch_floor" if n == len(t) // ps - matched
                   else "prefetch_host_capacity")
            _bounded_put(self.unprobed, rid, why)
            return 0
        anchor = nodes[-1] if nodes else c.tree.root(extra_key)
        pin = c.tree.root(extra_key)  # the leading run of matched nodes with a host copy
        for x in nodes:
            if x.host_value is None:
                break
            pin = x
        digests = page_keys(t[matched * ps : (matched + n) * ps], ps, c.chain.last_digest(anchor))
        c.tree.inc_host_ref(pin)
        op = PrefetchOp(
            request_id=rid,
            anchor=pin,
            tokens=t,
            start_page=matched,
            keys=[d.hex() for d in digests],
            host_pages=[],
            started=time.monotonic(),
            budget_s=cfg.prefetch_timeout(n * ps),
        )
        self.pending[rid] = op
        c.controller.submit_prefetch(op)
        return n * ps

    def worth_prefetching(self, tokens: int) -> bool:
        """Whether a gap of `tokens` uncached tokens is worth asking L3 for. An explicit
        `prefetch_threshold` is a hard floor. Unset: at least DEFAULT_PREFETCH_THRESHOLD (256)
        tokens, or fewer when the cost model (measured prefill speed against measured host and L3
        bandwidth) expects loading them to save at least PREFETCH_MIN_SAVING_S seconds."""
        if tokens <= 0:
            return False
        floor = self.c.config.prefetch_threshold
        if floor is not None:
            return tokens >= floor
        if tokens >= DEFAULT_PREFETCH_THRESHOLD:
            return True
        cost = self.c.controller.cost
        saving = None if cost is None else cost.load_saving("storage", tokens)
        # (timed on each rank: every rank prefetches only if every rank would)
        return self.c.controller.all_true(saving is not None and saving >= PREFETCH_MIN_SAVING_S)[0]

    def _allowance(self) -> int:
        share = self.c.config.prefetch_max_host_share
        return int(share * self.c.host_alloc.num_pages) - self.held

    def acked(self, op: PrefetchOp) -> None:
        """A prefetch operation finished on the worker (applied on the owner's thread)."""
        c = self.c
        op.acked = True
        if is_probe(op):
            found = op.completed * c.page_size
            c.counters.storage_probed_tokens += found
            if self.pending.get(op.request_id) is op:
                self._fetch(op)
            else:  # admitted before L3 answered (`take`), or the request went away
                c.counters.outcome("timeout" if op.taken is not None else "cancelled", found)
            return
        st = c.counters
        st.prefetch_pages += op.completed
        st.prefetch_tokens += op.completed * c.page_size
        st.prefetch_bytes += op.nbytes
        st.prefetch_seconds += op.seconds
        if op.taken is not None or op.cancelled:
            self.released(op)

    def _fetch(self, probe: PrefetchOp) -> None:
        """The probe found `probe.completed` leading pages in L3: reserve host pages for them
        and read them."""
        c = self.c
        ps = c.page_size
        outcome = c.counters.outcome
        n = max(0, min(probe.completed, self._allowance()))
        outcome("host_capacity", (probe.completed - n) * ps)  # the prefetch share is used up
        if n > 0:  # fetch only what is cheaper to load than to recompute (cost model)
            planned = c.controller.plan_load(0, n * ps, ps).storage_tokens // ps
            outcome("recomputed_by_cost_model", (n - planned) * ps)
            n = planned
        worth = self.worth_prefetching(n * ps)
        host = c.alloc_host(n) if worth else None
        found, n0 = probe.completed, max(0, min(probe.completed, self._allowance()))
        tail = [(n0 - n, "recomputed_by_cost_model"), (found - n0, "prefetch_host_capacity"),
                (len(probe.keys) - found, None)]
        if host is None:  # nothing in L3 (or too little), or no host room
            outcome("host_capacity" if worth else "below_threshold", n * ps)
            why = "prefetch_host_capacity" if worth else "below_prefetch_floor"
            _bounded_put(self.notes, probe.request_id, (probe.start_page, [(n, why), *tail]))
            c.counters.prefetch_skipped += 1
            del self.pending[probe.request_id]
            c.unpinned(c.tree.dec_host_ref(probe.anchor))
            trim_path(c, probe.anchor)
            return
        op = PrefetchOp(
            request_id=probe.request_id,
            anchor=probe.anchor,
            tokens=probe.tokens,
            start_page=probe.start_page,
            keys=probe.keys[:n],
            host_pages=host,
            started=probe.started,
            budget_s=c.config.prefetch_timeout(n * ps),
        )
        self.pending[op.request_id] = op
        self.held += n
        _bounded_put(self.tails, op.request_id, tail)
        c.host_inflight[id(op)] = host
        c.counters.prefetch_started += 1
        c.controller.submit_prefetch(op)

    def ready(self, rid: str) -> bool:
        """Whether the prefetch policy lets request `rid` be scheduled now. A fetch counts as
        done once its ack is applied (a probe's ack replaces it by its fetch, or ends it), so
        tensor-parallel ranks see the same; the timeout is over when it is over on every rank."""
        op = self.pending.get(rid)
        if op is None or op.acked:
            return True
        policy = self.c.config.prefetch_policy
        if policy == "best_effort":
            return True
        if policy == "wait_complete":
            return False
        return self.c.controller.all_true(time.monotonic() - op.started >= op.budget_s)[0]

    def progress(self, rid: str) -> tuple[int, int]:
        """(pages fetched so far, pages being fetched) of a pending prefetch; (0, 0) when none
        or while L3 is being asked."""
        op = self.pending.get(rid)
        return (op.completed, len(op.keys)) if op and not is_probe(op) else (0, 0)

    def cancel(self, rid: str) -> None:
        """Drop the prefetch of a request that went away; its host pages are given back as soon
        as the worker has stopped touching them."""
        self.notes.pop(rid, None)
        self.tails.pop(rid, None)
        self.unprobed.pop(rid, None)
        op = self.pending.pop(rid, None)
        if op is None:
            return
        op.cancelled = True
        op.stop.set()
        self.c.unpinned(self.c.tree.dec_host_ref(op.anchor))
        trim_path(self.c, op.anchor)
        if op.acked and not is_probe(op):  # (else released when its ack is applied)
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
        ps = c.page_size
        op.stop.set()
        if is_probe(op):
            op.cancelled = True
            op.taken = 0  # (its ack counts what L3 held as come too late)
            c.unpinned(c.tree.dec_host_ref(op.anchor))
            self.notes[rid] = (op.start_page, [(len(op.keys), "prefetch_timeout")])
            return 0
        # Pages read so far (the worker may still be reading): the fewest any rank has.
        take = c.controller.agree_min(op.completed)[0]
        op.late, op.accounted = not op.acked, take
        # Where the fetched pages attach: the end of their prefix, if the tree still holds all
        # of it (its device-only part may have been evicted meanwhile: then nothing is taken).
        ek = op.anchor.extra_key
        nodes = c.tree.match_split(op.tokens[: op.start_page * ps], ek)
        fetched = take
        if sum(x.num_pages for x in nodes) != op.start_page:
            c.counters.outcome("evicted_before_use", take * ps)
            take = 0
        op.taken = take
        short = "prefetch_timeout" if op.late else "corrupt" if op.corrupt else "read_failed"
        self.notes[rid] = (op.start_page, [
            (fetched, "" if take else "evicted_before_use"),  # "": in the tree now
            (len(op.keys) - fetched, short), *self.tails.pop(rid, [])])
        anchor = nodes[-1] if nodes else c.tree.root(ek)
        new_tokens, dups = self._insert_host_pages(op, anchor, take)
        # Pages the tree had meanwhile (a duplicate host copy, or one a device-only node gains):
        # served from the tree; the new ones get their outcome at admission (`HiRadixCache`).
        c.counters.outcome("already_cached", take * ps - new_tokens)
        if dups:
            c.host_alloc.free(dups)
            c.counters.prefetch_revoked_pages += len(dups)
        c.host_inflight[id(op)] = op.host_pages[take:]
        self.held -= take
        c.unpinned(c.tree.dec_host_ref(op.anchor))  # (acquire trims staged copies after this)
        if op.acked:  # (else released when its ack is applied)
            self.released(op)
        return new_tokens

    def admitted(self, fetched: int, hit: int, planned_out: int, wanted: int) -> None:
        """Outcomes of the `fetched` tokens a prefetch brought for a request at its admission:
        `hit` loaded; of the rest, those past the cost model's plan (`planned_out` tokens of the
        host hit were) recomputed by it; the others under the load-back threshold, or left for
        lack of device room (`wanted` tokens were to be loaded)."""
        if not fetched:
            return
        out = self.c.counters.outcome
        out("reused", hit)
        rest = fetched - hit
        by_plan = min(rest, planned_out)
        out("recomputed_by_cost_model", by_plan)
        below = wanted < self.c.config.load_back_threshold
        out("below_threshold" if below else "device_capacity", rest - by_plan)

    def _insert_host_pages(
        self, op: PrefetchOp, node: TreeNode, take: int
    ) -> tuple[int, list[int]]:
        c = self.c
        ps = c.page_size
        t = op.tokens
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
                child.stored = True
                c.events.stored(child, "host")
                c.host_candidates.push(child)
                return (take - j) * ps, dups
            m = common_pages(child.key, t[lo : (base + take) * ps], ps)
            if m < child.num_pages:
                child = c.tree.split(child, m)
            child.stored = True
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
        self.held -= len(left)
        if left:
            c.host_alloc.free(left)
        read = max(op.completed, op.read_here)  # (more than agreed: read, then given up)
        c.counters.prefetch_revoked_pages += max(0, read - (op.taken or 0))
        # The outcome of the pages admission did not take: all of them when the request went
        # away; else those still on their way then (late), or those a failed read never gave.
        rest = (len(op.keys) - op.accounted) * c.page_size
        if op.cancelled:
            c.counters.outcome("cancelled", len(op.keys) * c.page_size)
        elif op.late:
            c.counters.outcome("timeout", rest)
        else:
            c.counters.outcome("corrupt" if op.corrupt else "read_failed", rest)


# Notes of requests never admitted nor cancelled are dropped beyond this many (oldest first).
MAX_NOTES = 4096


def _bounded_put(d: dict[str, V], key: str, value: V) -> None:
    d.pop(key, None)
    d[key] = value
    if len(d) > MAX_NOTES:
        del d[next(iter(d))]


class ProbingTransfer(Transfer):
    """The `Transfer` the controller runs everything through. A probe (a `PrefetchOp` with no
    host pages) asks L3 which leading pages it has, batch by batch, on the prefetch worker, and
    counts them in `op.completed`; everything else is `inner`'s, member by member (each one
    declared on `Transfer`, so none is lost in forwarding)."""

    def __init__(self, inner: Transfer) -> None:
        self.inner = inner
        self.bytes_per_token = inner.bytes_per_token
        self.page_size = inner.page_size
        self.record_bytes = inner.record_bytes
        self.pipelined_reads = inner.pipelined_reads

    def device_to_host(
        self, device_pages: Sequence[int], host_pages: Sequence[int], ready: Event | None = None
    ) -> Event | None:
        return self.inner.device_to_host(device_pages, host_pages, ready)

    def host_to_device(
        self, host_pages: Sequence[int], device_pages: Sequence[int], layerwise: bool = False
    ) -> LayerDoneCounter | None:
        return self.inner.host_to_device(host_pages, device_pages, layerwise)

    def exists(self, keys: Sequence[str]) -> int:
        return self.inner.exists(keys)

    def store(self, keys: Sequence[str], host_pages: Sequence[int], op: BackupOp) -> None:
        self.inner.store(keys, host_pages, op)

    def read_batch(self, keys: Sequence[str], host_pages: Sequence[int]) -> tuple[int, int]:
        return self.inner.read_batch(keys, host_pages)

    def warm_staging(self, n: int) -> object:
        return self.inner.warm_staging(n)

    def ready_event(self) -> Event | None:
        return self.inner.ready_event()

    def quiet_host(self) -> None:
        self.inner.quiet_host()

    def fetch(self, keys: Sequence[str], host_pages: Sequence[int], op: PrefetchOp) -> bool:
        if host_pages:
            return self.inner.fetch(keys, host_pages, op)
        n = self.inner.exists(keys)  # a probe: count the leading run present, read nothing
        op.completed += n
        return n == len(keys)
