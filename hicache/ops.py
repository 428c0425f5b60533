"""The operations the transfer controller runs, and the `Transfer` protocol that moves bytes.

Operations are plain objects: the owner of the tree builds one, the controller's worker threads
fill in its results, and the owner applies it when it is acked (`hicache.acks`). Each carries its
submission number `seq`: within one kind (write, backup, prefetch) operations complete in that
order, which is what lets tensor-parallel ranks agree on how many of each have completed
(`hicache.sync`).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.radix import Tokens, TreeNode
    from hicache.transfer import Event, LayerDoneCounter


# --------------------------------------------------------------------------------------------
# Operations
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class WriteOp:
    """device -> host copy of one node's pages. The node is locked until the ack."""

    node: TreeNode
    device_pages: list[int]
    host_pages: list[int]
    keys: list[str] = field(default_factory=list)  # L3 keys of the pages (when L3 is set)
    error: str | None = None
    ready: Any = None  # CUDA event recorded on the compute stream at submission
    event: Any = None  # completion of the copy (acked once it has happened)
    seq: int = -1  # submission order (set by the controller)


@dataclass(eq=False)
class BackupOp:
    """host -> storage of pages. `node` is host-pinned until the ack; when the node already left
    the tree (write_back host eviction) `node` is None and the pages are freed at the ack."""

    node: TreeNode | None
    host_pages: list[int]
    keys: list[str]
    written: int = 0
    skipped: int = 0  # already present in storage
    failed: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    seq: int = -1  # submission order (set by the controller)


@dataclass(eq=False)
class PrefetchOp:
    """storage -> host of the pages of `tokens` after `start_page`, stopping at the first miss.

    Thread-side fields (`completed`, `done`, counters) are written by the prefetch worker;
    cache-side fields (`taken`, `cancelled`, `released`) only by the tree's owner.
    """

    request_id: str
    anchor: TreeNode
    tokens: Tokens
    start_page: int
    keys: list[str]
    host_pages: list[int]
    started: float
    budget_s: float
    completed: int = 0  # leading pages written to host and valid
    stop: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    nbytes: int = 0
    seconds: float = 0.0
    corrupt: int = 0
    error: str | None = None
    taken: int | None = None  # pages the cache inserted into the tree
    cancelled: bool = False
    released: bool = False  # leftover host pages given back
    acked: bool = False  # its completion was applied by the owner (agreed by every rank)
    # At admission (`take`): whether the read was still going on, and how many of its pages
    # had an outcome counted then (the rest get theirs when it is released).
    late: bool = False
    accounted: int = 0
    # Pages this rank read when the ranks agreed on fewer (`completed` is then the agreed
    # count); -1: none agreed away.
    read_here: int = -1
    seq: int = -1  # submission order (set by the controller)


Op = WriteOp | BackupOp | PrefetchOp


# --------------------------------------------------------------------------------------------
# Data movement
# --------------------------------------------------------------------------------------------


class Transfer(ABC):
    """How bytes move. `TensorTransfer` for real pools, `SimTransfer` (simulated mode) moves
    nothing, `ProbingTransfer` wraps either for the prefetch worker's L3 probes.

    Every capability the controller uses is a member here, with the default of a transfer that
    lacks it; the controller calls these members and never probes an object for attributes.
    The four facts below are fixed when a transfer is made (its pools and codec never change)."""

    # KV bytes of one token in the pools; None: this transfer moves no bytes (simulated), so
    # there is no cost model to feed.
    bytes_per_token: int | None = None
    page_size: int = 1  # tokens per device page
    record_bytes: int = 0  # bytes of one L3 page record (0: no L3 codec)
    pipelined_reads: bool = False  # `read_batch` works: a prefetch may split over reader threads

    @abstractmethod
    def device_to_host(
        self, device_pages: Sequence[int], host_pages: Sequence[int], ready: Event | None = None
    ) -> Event | None:
        """Start the copy once `ready` (an event on the compute stream) has fired; return its
        completion event (None: finished)."""

    @abstractmethod
    def host_to_device(
        self, host_pages: Sequence[int], device_pages: Sequence[int], layerwise: bool = False
    ) -> LayerDoneCounter | None:
        """Start the copy; return its per-layer counter (None: finished)."""

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> int:
        """How many leading `keys` L3 holds."""

    @abstractmethod
    def store(self, keys: Sequence[str], host_pages: Sequence[int], op: BackupOp) -> None:
        """Write the pages' records; count into `op`."""

    @abstractmethod
    def fetch(self, keys: Sequence[str], host_pages: Sequence[int], op: PrefetchOp) -> bool:
        """Fetch pages in order into `host_pages`, advancing `op.completed`; return False at the
        first missing or invalid page."""

    def read_batch(self, keys: Sequence[str], host_pages: Sequence[int]) -> tuple[int, int]:
        """Read, check and place one batch (thread-safe for disjoint `host_pages`); return
        (leading pages placed, corrupt records found). Only where `pipelined_reads`."""
        raise NotImplementedError(f"{type(self).__name__} has no pipelined reads")

    def warm_staging(self, n: int) -> object:
        """Make this thread's staging memory for `n` records ready (a reader thread's start)."""
        return None

    def ready_event(self) -> Event | None:
        """An event on the caller's (compute) stream that a write waits for (None: no streams)."""
        return None

    def quiet_host(self) -> None:
        """Wait until no copy into or out of host pages is in flight (CUDA; nothing on CPU)."""
        return None


def kind_of(op: Op) -> str:
    """The worker queue an operation runs on: `write`, `backup` or `prefetch`."""
    if isinstance(op, WriteOp):
        return "write"
    return "backup" if isinstance(op, BackupOp) else "prefetch"


KINDS = ("write", "backup", "prefetch")
