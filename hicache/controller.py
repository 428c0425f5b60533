"""Background transfer machinery: the only place in hicache where threads live.

Four kinds of movement:

- device -> host *write* (write-through backup, asynchronous, acked),
- host -> device *load* (load-back: issued at admission on the load stream; the forward waits
  for it on the device, all at once or layer by layer through a `LayerDoneCounter`),
- host -> storage *backup* (asynchronous, acked),
- storage -> host *prefetch* (asynchronous, progress visible while it runs, acked).

Operations (`hicache.ops`) are plain objects. Worker threads fill in their results and queue
them as completed, one FIFO per kind; the owner of the tree (`HiRadixCache.poll`) takes the acks
and changes the tree, so the tree is only ever touched by one thread. In synchronous mode (tests,
simulation) an operation runs inline when submitted and its ack waits in the same queue. Under
tensor parallelism (`hicache.sync`) the owner takes, per kind, only as many acks as every rank
has, and the ranks agree on what the operations found before the tree uses it.

A storage backend that raises is not retried for `storage_retry_backoff` seconds (a `hicache_client.backoff.Backoff`, doubling up to
30 s): meanwhile prefetches are not started and backups are dropped (counted). Worker threads
catch everything: a backend error never kills a thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from hicache.costmodel import CostModel, LoadPlan
from hicache.ops import KINDS, BackupOp, Op, PrefetchOp, Transfer, WriteOp, kind_of
from hicache.sync import SOLO, RankSync
from hicache.transfer import DONE, LayerDoneCounter
from hicache.transfer_tensor import TensorTransfer, fetch_pipelined, start_readers
from hicache_client.backoff import Backoff

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
# A prefetch is split across reader threads only into sub-batches of at least this many pages.
MIN_READ_PAGES = 16

__all__ = ["BackupOp", "PrefetchOp", "TensorTransfer", "Transfer", "TransferController", "WriteOp"]


# --------------------------------------------------------------------------------------------
# The controller
# --------------------------------------------------------------------------------------------


class TransferController:
    """Runs operations on worker threads (or inline) and collects their acks."""

    def __init__(
        self,
        transfer: Transfer,
        *,
        has_storage: bool,
        batch_pages: int = 128,
        retry_backoff_s: float = 1.0,
        synchronous: bool = False,
        readers: int = 4,
        load_margin: float = 1.0,
        sync: RankSync = SOLO,
        writes_storage: bool = True,
    ) -> None:
        """`sync`: the tensor-parallel group's agreement (`hicache.sync`; one rank: none).
        `writes_storage=False`: backups write nothing (another rank writes the pages all ranks
        share: MLA's one latent, written by rank 0) and count as already present."""
        self.transfer = transfer
        # Prefetch reads in flight at once (sub-batches of one request, placed in order).
        self.readers = readers
        self._reader_pool: ThreadPoolExecutor | None = None
        self.has_storage = has_storage
        self.batch_pages = batch_pages
        self.synchronous = synchronous
        self.sync = sync
        self.writes_storage = writes_storage
        # Completed operations not yet handed to the owner, per kind, in completion order
        # (which is submission order within a kind: one worker thread per kind).
        self._done: dict[str, deque[Op]] = {k: deque() for k in KINDS}
        self._seq = 0
        # Whether L3 may be asked, as every rank agreed at the latest `acks()` (TP only).
        self._storage_agreed = has_storage
        self._pending = 0  # submitted and not yet acked
        self._pending_lock = threading.Lock()
        self._idle = threading.Condition(self._pending_lock)
        # Storage health.
        self._breaker = Backoff(
            "L3 storage", initial_s=retry_backoff_s, max_s=max(MAX_BACKOFF_S, retry_backoff_s),
            jitter=0.0,
        )
        self.storage_errors = 0  # read by the owner; only grows
        # Measured tier bandwidths and prefill speed: the load-vs-recompute decision.
        bpt = transfer.bytes_per_token
        self.cost: CostModel | None = (
            CostModel(bpt, margin=load_margin) if bpt is not None else None
        )
        # Writes whose copy was issued and has not completed yet (CUDA): acked when it has.
        self._inflight: list[WriteOp] = []
        self._progress = threading.Event()  # set whenever an ack is queued
        self._queues: dict[str, queue.SimpleQueue[Op | None]] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False
        if not synchronous:
            for name in ("write", "backup", "prefetch"):
                q: queue.SimpleQueue[Op | None] = queue.SimpleQueue()
                t = threading.Thread(
                    target=self._worker, args=(q,), name=f"hicache-{name}", daemon=True
                )
                self._queues[name] = q
                self._threads.append(t)
                t.start()
            if has_storage:
                self._start_readers()

    def _start_readers(self) -> None:
        """Start the prefetch readers now, so that a restarted engine's first L3 hit does not
        pay for thread starts and fresh staging memory inside its time to first token."""
        if not self.transfer.pipelined_reads or self.readers <= 1:
            return  # no pipelined reads (`_run_prefetch`)
        self._reader_pool = start_readers(
            self.readers, lambda: self.transfer.warm_staging(MIN_READ_PAGES)
        )

    # -- health -------------------------------------------------------------------------------

    def storage_available(self) -> bool:
        """Whether L3 may be asked now (not inside a back-off after a failure): this rank's
        view, for the worker threads."""
        return self.has_storage and self._breaker.seconds_until_retry() == 0.0

    def storage_usable(self) -> bool:
        """`storage_available` as the owner's decisions see it: under tensor parallelism, what
        every rank agreed at the latest `acks()` (all ranks start a prefetch, or none does)."""
        if self.sync.solo:
            return self.storage_available()
        return self.has_storage and self._storage_agreed

    # -- agreement (hicache.sync) -------------------------------------------------------------

    def agree_min(self, *values: int) -> list[int]:
        """Each value's minimum over the ranks (itself with one rank)."""
        return self.sync.agree_min(*values) if not self.sync.solo else [int(v) for v in values]

    def all_true(self, *flags: bool) -> list[bool]:
        """Per flag: whether it holds on every rank."""
        return self.sync.all_true(*flags) if not self.sync.solo else [bool(f) for f in flags]

    def _storage_failed(self, what: str, e: BaseException) -> None:
        """A storage call raised: serve from L1/L2 and back off (doubling up to
        `MAX_BACKOFF_S`); `hicache_client.backoff.Backoff` logs the first failure at WARNING."""
        self.storage_errors += 1
        logger.debug("L3 storage %s failed: %s", what, e)
        self._breaker.failure(e)

    def _storage_ok(self) -> None:
        self._breaker.success()

    @property
    def storage_down(self) -> bool:
        return self._breaker.down

    # -- submission ----------------------------------------------------------------------------

    def _submit(self, kind: str, op: Op) -> None:
        if self._closed:
            raise RuntimeError("transfer controller is closed")
        with self._pending_lock:
            self._pending += 1
        op.seq = self._seq
        self._seq += 1
        if self.synchronous:
            self._run(op)
        else:
            self._queues[kind].put(op)

    def submit_write(self, op: WriteOp) -> None:
        if op.ready is None:
            op.ready = self.transfer.ready_event()
        self._submit("write", op)

    def submit_backup(self, op: BackupOp) -> None:
        self._submit("backup", op)

    def submit_prefetch(self, op: PrefetchOp) -> None:
        self._submit("prefetch", op)

    def exists(self, keys: Sequence[str]) -> int:
        """Leading run of `keys` present in storage, asked now; 0 while the backend is down."""
        if not self.storage_available():
            return 0
        try:
            n = self.transfer.exists(keys)
        except Exception as e:  # noqa: BLE001
            self._storage_failed("exists", e)
            return 0
        self._storage_ok()
        return n

    def acks(self) -> list[Op]:
        """The completed operations not yet handed out, in submission order. Under tensor
        parallelism: per kind, as many as every rank has completed, with their results agreed
        (`_agree_results`); one or two collectives."""
        self._sweep_inflight(block=False)
        counts = [len(self._done[k]) for k in KINDS]
        if not self.sync.solo:
            agreed = self.sync.agree_min(*counts, self.storage_available())
            counts, self._storage_agreed = agreed[:-1], bool(agreed[-1])
        out: list[Op] = []
        for k, n in zip(KINDS, counts):
            d = self._done[k]
            out.extend(d.popleft() for _ in range(n))
        out.sort(key=lambda op: op.seq)
        if out and not self.sync.solo:
            self._agree_results(out)
        return out

    def _agree_results(self, ops: list[Op]) -> None:
        """Make every rank see the same results: a prefetch found or read the fewest pages any
        rank did; a write or backup failed if it failed on any rank. The operations themselves
        are checked to be the same ones (their submission numbers)."""
        mins: list[int] = []
        maxes: list[int] = []
        for op in ops:
            if isinstance(op, PrefetchOp):
                mins.append(op.completed)
            else:
                failed = op.error is not None or isinstance(op, BackupOp) and op.failed > 0
                maxes.append(int(failed))
        seqs = [sum(op.seq for op in ops), len(ops)]
        lo, hi = self.sync.agree([*mins, *seqs], [*maxes, *seqs])
        if lo[len(mins):] != hi[len(maxes):]:
            from hicache.sync import RankDivergence

            raise RankDivergence(f"ranks acked different operations (rank {self.sync.rank}: "
                                 f"seqs {[op.seq for op in ops][:8]}...)")
        i = j = 0
        for op in ops:
            if isinstance(op, PrefetchOp):
                if lo[i] < op.completed:
                    op.read_here = op.completed
                op.completed = lo[i]
                i += 1
            else:
                if hi[j] and op.error is None:
                    op.error = "failed on another tensor-parallel rank"
                j += 1

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every submitted operation has been acked (not necessarily consumed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            with self._idle:
                if not self._idle.wait_for(
                    lambda: self._pending == len(self._inflight), left
                ):
                    return False
                if self._pending == 0:
                    return True
            self._sweep_inflight(block=True)

    def wait_progress(self, timeout: float) -> bool:
        """Block up to `timeout` s until some operation completes (e.g. a prefetch the
        scheduler waits for), instead of spinning on `acks()` and starving the workers of the
        GIL. True when an ack is waiting."""
        self._sweep_inflight(block=False)
        if any(self._done.values()):
            return True
        if self._pending == 0:
            return False
        got = self._progress.wait(timeout)
        self._progress.clear()
        return got

    def _sweep_inflight(self, block: bool) -> None:
        """Ack the in-flight writes whose copy completed (all of them, waiting, if `block`)."""
        if not self._inflight:
            return
        with self._pending_lock:
            pending = list(self._inflight)
        done: list[WriteOp] = []
        for op in pending:  # the leading run only: writes are acked in submission order
            if block:
                op.event.synchronize()
            if not op.event.query():
                break
            done.append(op)
        if not done:
            return
        with self._pending_lock:
            for op in done:
                self._inflight.remove(op)
        for op in done:
            self._ack(op)

    @property
    def pending(self) -> int:
        """Operations not yet handed to the owner: running, or acked and waiting in the queue
        (a worker queues its ack before it stops counting the op, so none is ever in neither)."""
        return self._pending + sum(len(d) for d in self._done.values())

    @property
    def threads_alive(self) -> int:
        """Worker threads running (3 in threaded mode, 0 when synchronous or closed)."""
        return sum(t.is_alive() for t in self._threads)

    # -- synchronous movement -------------------------------------------------------------

    def plan_load(self, host_tokens: int, storage_tokens: int, page_size: int = 1) -> LoadPlan:
        """How many host then storage tokens of a cached prefix to load (the rest is cheaper to
        recompute), from what was measured so far; everything while nothing is measured. Under
        tensor parallelism the ranks (each timed on its own) load the least any rank would."""
        if self.cost is None:
            return LoadPlan(host_tokens, storage_tokens, 0, 0.0, 0.0)
        plan = self.cost.plan(host_tokens, storage_tokens, page_size)
        if self.sync.solo:
            return plan
        h, s = self.sync.agree_min(plan.host_tokens, plan.storage_tokens)
        rest = host_tokens + storage_tokens - h - s
        return LoadPlan(h, s, rest, plan.load_s, plan.recompute_s)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The owner reports a forward's prompt tokens and wall time (feeds `plan_load`)."""
        if self.cost is not None:
            self.cost.observe_prefill(tokens, seconds)

    def load(
        self, host_pages: Sequence[int], device_pages: Sequence[int], layerwise: bool = False
    ) -> LayerDoneCounter:
        """host -> device, issued now on the load stream. Without `layerwise` the current
        (compute) stream is made to wait for the whole load before returning (a device-side
        wait; the host does not block). With `layerwise` the caller must call
        `counter.wait(i)` before layer i reads the pool (`ForwardBatch.wait_layer`)."""
        t0 = time.perf_counter()
        ctr = self.transfer.host_to_device(host_pages, device_pages, layerwise)
        if ctr is None:
            return LayerDoneCounter([DONE], 1)
        if self.cost is not None and ctr.done() and host_pages:  # synchronous (CPU): timed here
            nbytes = len(host_pages) * self.transfer.page_size * self.cost.bytes_per_token
            self.cost.observe_load("host", nbytes, time.perf_counter() - t0)
        if not layerwise:
            ctr.wait_all()
        return ctr

    def write_now(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        """device -> host before the device pages are freed: later work on the compute stream
        waits for the copy on the device; the host does not block."""
        ev = self.transfer.device_to_host(device_pages, host_pages, self.transfer.ready_event())
        if ev is not None:
            LayerDoneCounter([ev], 1).wait_all()

    # -- workers ------------------------------------------------------------------------------

    def _worker(self, q: queue.SimpleQueue[Op | None]) -> None:
        while True:
            op = q.get()
            if op is None:
                return
            self._run(op)

    def _ack(self, op: Op) -> None:
        self._done[kind_of(op)].append(op)
        with self._idle:
            self._pending -= 1
            if self._pending == len(self._inflight):
                self._idle.notify_all()
        self._progress.set()

    def _run(self, op: Op) -> None:
        in_flight = False
        try:
            if isinstance(op, WriteOp):
                op.event = self.transfer.device_to_host(op.device_pages, op.host_pages, op.ready)
                with self._pending_lock:  # behind an earlier write still in flight: queue up
                    in_flight = op.event is not None and (
                        bool(self._inflight) or not op.event.query()
                    )
            elif isinstance(op, BackupOp):
                self._run_backup(op)
            else:
                self._run_prefetch(op)
        except Exception as e:  # noqa: BLE001 - a worker never dies
            logger.exception("transfer %s failed", type(op).__name__)
            op.error = f"{type(e).__name__}: {e}"
        finally:
            if isinstance(op, PrefetchOp):
                op.done.set()
            if in_flight:  # acked by the owner's poll once its event has completed
                with self._pending_lock:
                    self._inflight.append(op)  # type: ignore[arg-type]
                    self._idle.notify_all()
            else:
                self._ack(op)

    def _run_backup(self, op: BackupOp) -> None:
        if not self.writes_storage:  # another rank writes these shared pages
            op.skipped = len(op.keys)
            return
        if not self.storage_available():
            op.failed = len(op.keys)
            return
        t0 = time.perf_counter()
        try:
            present = self.transfer.exists(op.keys)
            op.skipped = present
            for i in range(present, len(op.keys), self.batch_pages):
                j = min(i + self.batch_pages, len(op.keys))
                self.transfer.store(op.keys[i:j], op.host_pages[i:j], op)
            self._storage_ok()
        except Exception as e:  # noqa: BLE001
            self._storage_failed("write", e)
            op.failed = len(op.keys) - op.written - op.skipped
            op.error = f"{type(e).__name__}: {e}"
        op.seconds = time.perf_counter() - t0

    def _run_prefetch(self, op: PrefetchOp) -> None:
        if not self.storage_available():
            return
        t0 = time.perf_counter()
        read = self.transfer.read_batch if self.transfer.pipelined_reads else None
        try:
            n = len(op.keys)  # prefetch() reserved host pages for the leading run present
            i = 0
            if (read is not None and op.host_pages and not self.synchronous
                    and self.readers > 1 and min(n, self.batch_pages) > MIN_READ_PAGES):
                self._fetch_pipelined(op, read)
                i = n
            while i < n and not op.stop.is_set():
                j = min(i + self.batch_pages, n)
                if not self.transfer.fetch(op.keys[i:j], op.host_pages[i:j], op):
                    break
                i = j
            self._storage_ok()
        except Exception as e:  # noqa: BLE001
            self._storage_failed("read", e)
            op.error = f"{type(e).__name__}: {e}"
        op.seconds = time.perf_counter() - t0
        if self.cost is not None and op.nbytes:
            self.cost.observe_load("storage", op.nbytes, op.seconds)

    def timed_read(self, keys: Sequence[str], host_pages: Sequence[int]) -> PrefetchOp:
        """Read `keys` into `host_pages` now, on the calling thread, by the path a prefetch
        takes (pipelined over the readers when it is large enough), measured as one: it feeds
        the cost model. For the start-up calibration (`hicache.calibration`)."""
        op = PrefetchOp(request_id="calibration", anchor=None,  # type: ignore[arg-type]
                        tokens=(), start_page=0, keys=list(keys), host_pages=list(host_pages),
                        started=time.monotonic(), budget_s=float("inf"))
        self._run_prefetch(op)
        return op

    def _fetch_pipelined(
        self, op: PrefetchOp, read: Callable[[Sequence[str], Sequence[int]], tuple[int, int]]
    ) -> None:
        assert self._reader_pool is not None  # started with the controller (`_start_readers`)
        record_bytes = self.transfer.record_bytes
        per_reader = -(-len(op.keys) // self.readers)
        sub = min(self.batch_pages, max(MIN_READ_PAGES, per_reader))
        fetch_pipelined(op, read, self._reader_pool, self.readers, sub, record_bytes)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._reader_pool is not None:
            self._reader_pool.shutdown(wait=True)
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout=30)
