"""Applying the transfer controller's acks to the tree, on the owner's thread.

`TransferController` runs device -> host writes, host -> L3 backups and L3 -> host prefetches on
its threads and queues each finished operation; `Acks.poll` takes them and changes the tree:
unpins what the operation pinned, counts, chains a finished host copy on to L3, and drops the
host copies of a failed write. Backups are submitted through `Acks.backup`, so the storage events
of a backup are emitted when it is acked.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from hicache.controller import BackupOp, Op, WriteOp
from hicache.emit import StoredRun
from hicache.staging import trim

if TYPE_CHECKING:
    from hicache.owner import CacheOwner
    from hicache.prefetch import Prefetcher
    from hicache.radix import TreeNode

logger = logging.getLogger(__name__)


class Acks:
    def __init__(self, owner: CacheOwner, prefetcher: Prefetcher) -> None:
        self.c = owner
        self.prefetcher = prefetcher
        # Storage events of backups whose node left the tree before the ack, by id(op).
        self._runs: dict[int, StoredRun] = {}

    def backup(self, node: TreeNode, host_pages: list[int], keys: list[str]) -> None:
        """host -> L3 of `node`'s host copy; the node is host-pinned until the ack."""
        self.c.tree.inc_host_ref(node)
        self.c.controller.submit_backup(BackupOp(node, host_pages, keys))

    def backup_detached(self, node: TreeNode, host_pages: list[int], keys: list[str]) -> None:
        """host -> L3 of the host copy of a node leaving the tree (write_back host eviction):
        the pages belong to the operation and are freed at the ack."""
        op = BackupOp(None, host_pages, keys)
        self.c.host_inflight[id(op)] = host_pages
        if self.c.events.active:
            self._runs[id(op)] = self.c.events.run(node)
        self.c.controller.submit_backup(op)

    def poll(self) -> int:
        """Apply every completed background transfer; return how many were applied."""
        done = 0
        while True:
            acks = self.c.controller.acks()
            if not acks:
                return done
            for op in acks:
                self.apply(op)
                done += 1

    def apply(self, op: Op) -> None:
        c = self.c
        ps = c.page_size
        st = c.counters
        if isinstance(op, WriteOp):
            c.unpinned(c.tree.dec_lock(op.node))
            if op.error is not None:
                self._drop_failed_write(op)
                return
            st.backup_tokens += len(op.host_pages) * ps
            if not op.node.removed and c.admit(op.node):
                self.backup(op.node, op.host_pages, op.keys)
        elif isinstance(op, BackupOp):
            st.storage_backup_pages += op.written
            st.storage_backup_skipped_pages += op.skipped
            st.storage_failed_pages += op.failed
            st.storage_backup_bytes += op.nbytes
            st.storage_backup_seconds += op.seconds
            self._storage_events(op)
            if op.node is None:
                c.host_alloc.free(c.host_inflight.pop(id(op)))
                return
            c.unpinned(c.tree.dec_host_ref(op.node))
            if op.node.removed:
                return
            covered = self._covered(op)
            if not op.failed and op.error is None:
                for x in covered:
                    x.stored = True
            if c.config.host_memory_mode == "buffer_only":
                # The staged copies of this backup, and of ancestors whose own backup was acked
                # while this one pinned them.
                trim(c, [x for x in c.tree.path(op.node) if x in covered or x.stored])
        else:
            self.prefetcher.acked(op)

    def _storage_events(self, op: BackupOp) -> None:
        ev = self.c.events
        run = self._runs.pop(id(op), None)
        if not ev.active:
            return
        if op.failed or op.error is not None:
            # Which of the pages after the leading run already present landed is not known.
            ev.removed_keys(op.keys[op.skipped :], "storage")
            return
        if run is None:
            assert op.node is not None
            run = self._run_of(op)
        ev.stored_run(run, "storage")

    def _covered(self, op: BackupOp) -> list[TreeNode]:
        """The nodes a backup of a node still in the tree covers, deepest first: the node, and
        the upper parts it was split into since (its ancestors), up to `len(op.keys)` pages."""
        nodes: list[TreeNode] = []
        pages = 0
        for x in self.c.tree.path(op.node):  # type: ignore[arg-type]
            nodes.append(x)
            pages += x.num_pages
            if pages >= len(op.keys):
                break
        return nodes

    def _run_of(self, op: BackupOp) -> StoredRun:
        ev = self.c.events
        nodes = self._covered(op)
        nodes.reverse()
        top = ev.run(nodes[0])
        hashes = tuple(h for x in nodes for h in ev.hashes(x))
        tokens = tuple(tok for x in nodes for tok in x.key)
        return StoredRun(hashes, top.parent_hash, tokens, top.extra_key)

    def _drop_failed_write(self, op: WriteOp) -> None:
        """A device -> host copy failed: forget the host copies it was to fill."""
        c = self.c
        logger.error("device->host write failed (%s); dropping %d host pages", op.error,
                     len(op.host_pages))
        pages = set(op.host_pages)
        for x in c.tree.path(op.node):
            if x.host_value is not None and pages.issuperset(x.host_value):
                c.events.removed(x, "host")
                c.host_alloc.free(x.host_value)
                x.host_value = None

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every background transfer (and the ones their acks start) to finish. Under
        tensor parallelism every rank leaves together: when all ranks are idle, or when any
        rank timed out (then every rank raises)."""
        ctl = self.c.controller
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            idle = ctl.wait_idle(left)
            applied = self.poll()
            in_time, drained = ctl.all_true(idle, ctl.pending == 0)
            if not in_time:
                raise TimeoutError("background transfers did not finish in time")
            if applied == 0 and drained:
                return
