"""`TensorTransfer`: moves real KV between a `DeviceKVPool`, a `HostKVPool` and a
`StorageBackend` for the `TransferController` (which runs it on its worker threads)."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from hicache.ops import BackupOp, PrefetchOp, Transfer
from hicache.pools import DeviceKVPool, HostKVPool
from hicache.transfer import Event, LayerDoneCounter, PageMover
from hicache_client.backend import StorageBackend
from hicache_client.codec import HEADER_BYTES, PageCodec

logger = logging.getLogger(__name__)


class TensorTransfer(Transfer):
    """Moves real KV between a `DeviceKVPool`, a `HostKVPool` and a `StorageBackend`.

    Device <-> host through `PageMover` (async on CUDA, events); host <-> L3 in batches: a
    batch's records are read into one staging buffer, their headers checked together and their
    payloads placed into the host pool with one indexed copy (no per-page tensor work).
    """

    def __init__(
        self,
        device: DeviceKVPool,
        host: HostKVPool,  # None for a device-only cache
        storage: StorageBackend | None,
        codec: PageCodec | None,
    ) -> None:
        self.device = device
        self.host = host
        self.storage = storage
        self.codec = codec
        # None for a device-only cache (no host tier: nothing ever moves).
        self._mover = PageMover(device, host) if host is not None else None
        self._local = threading.local()
        self._template: tuple[np.ndarray, np.ndarray] | None = None
        self.bytes_per_token = device.bytes_per_token
        self.page_size = device.page_size
        self.record_bytes = codec.record_bytes if codec is not None else 0
        self.pipelined_reads = True

    @property
    def mover(self) -> PageMover:
        if self._mover is None:
            raise RuntimeError("this cache has no host tier")
        return self._mover

    def _staging(self, n: int) -> tuple[torch.Tensor, list[memoryview]]:
        """`n` record buffers of this thread: as a `[n, record_bytes]` uint8 tensor and views.
        The buffer is kept and only ever grows (to the largest batch this thread has read)."""
        assert self.codec is not None
        size = self.codec.record_bytes
        t: torch.Tensor | None = getattr(self._local, "tensor", None)
        if t is None or t.numel() < n * size:
            t = self.warm_staging(n)
        mv = self._local.view
        return t[: n * size].view(n, size), [mv[i * size : (i + 1) * size] for i in range(n)]

    def warm_staging(self, n: int) -> torch.Tensor:
        """Allocate this thread's staging buffer for at least `n` records and touch every page
        of it (a fresh buffer faults on first use); return it as a flat uint8 tensor."""
        assert self.codec is not None
        t: torch.Tensor | None = getattr(self._local, "tensor", None)
        need = n * self.codec.record_bytes
        if t is None or t.numel() < need:
            t = torch.empty(need, dtype=torch.uint8)
            t.zero_()  # fault it in now, not under a request's read
            self._local.tensor = t
            self._local.view = t.numpy().data  # a flat uint8 memoryview over the tensor
        return t

    def _header_template(self) -> tuple[np.ndarray, np.ndarray]:
        """The header bytes every record of this cache has, and the mask of the fixed ones
        (all but the version, key digest and checksum, which `batch_get` has checked per
        record): magic, header length, namespace, tokens, dtype, layout, shape, payload length."""
        if self._template is None:
            assert self.codec is not None
            hdr = np.frombuffer(
                self.codec.encode("", bytes(self.codec.payload_bytes))[:HEADER_BYTES], np.uint8
            ).copy()
            mask = np.ones(HEADER_BYTES, dtype=bool)
            mask[4:6] = False  # record version (any that `verify_record` reads)
            mask[40:72] = False  # key digest
            mask[120:] = False  # checksum area (v1: reserved + CRC32, v2: XXH3-64)
            self._template = (hdr, mask)
        return self._template

    def ready_event(self) -> Event | None:
        """An event on the caller's (compute) stream: a write waits for it before reading."""
        if self._mover is not None and self._mover.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device.device))
            return ev
        return None

    def quiet_host(self) -> None:
        if self._mover is not None:
            self._mover.host_quiet()

    def device_to_host(
        self, device_pages: Sequence[int], host_pages: Sequence[int], ready: Event | None = None
    ) -> Event:
        return self.mover.d2h(device_pages, host_pages, ready)

    def host_to_device(
        self, host_pages: Sequence[int], device_pages: Sequence[int], layerwise: bool = False
    ) -> LayerDoneCounter:
        return self.mover.h2d(host_pages, device_pages, layerwise)

    def exists(self, keys: Sequence[str]) -> int:
        assert self.storage is not None
        return self.storage.batch_exists(keys)

    def store(self, keys: Sequence[str], host_pages: Sequence[int], op: BackupOp) -> None:
        """Write the pages' records; count into `op` (a `BackupOp`)."""
        assert self.storage is not None and self.codec is not None
        self.mover.host_quiet()  # a write into these host pages may still be in flight (CUDA)
        n = len(keys)
        _, views = self._staging(n)
        payloads = torch.empty((n, self.host.page_nbytes), dtype=torch.uint8)
        self.host.gather_payloads(host_pages, payloads)
        pay = payloads.numpy()
        for i, (key, view) in enumerate(zip(keys, views)):
            self.codec.encode_into(key, pay[i].data, view)
        ok = self.storage.batch_set(list(keys), views)
        n_ok = sum(ok)
        op.written += n_ok
        op.failed += len(ok) - n_ok
        op.nbytes += n_ok * self.codec.record_bytes

    def fetch(self, keys: Sequence[str], host_pages: Sequence[int], op: PrefetchOp) -> bool:
        """Read the pages' records into `host_pages` in order, advancing `op.completed` (a
        `PrefetchOp`); False at the first missing or invalid page."""
        good, corrupt = self.read_batch(keys, host_pages)
        op.corrupt += corrupt
        op.completed += good
        assert self.codec is not None
        op.nbytes += good * self.codec.record_bytes
        return good == len(keys)

    def read_batch(self, keys: Sequence[str], host_pages: Sequence[int]) -> tuple[int, int]:
        """Read, check and place one batch; thread-safe for disjoint `host_pages` (one staging
        buffer per thread). Returns (leading pages placed, corrupt records found)."""
        assert self.storage is not None and self.codec is not None
        self.mover.host_quiet()  # a load may still read host pages being reused (CUDA)
        table, views = self._staging(len(keys))
        ok = self.storage.batch_get(list(keys), views)  # checksums and key digests checked
        good = next((i for i, g in enumerate(ok) if not g), len(ok))
        # The read stops at the first page not delivered: a corrupt record (the backend
        # dropped it), or one that is gone (a miss, a failure).
        corrupt = int(good < len(keys) and keys[good] in self.storage.corrupt_in_last_get())
        if good:
            hdr, mask = self._header_template()
            heads = table[:good, :HEADER_BYTES].numpy()
            bad = np.flatnonzero(~(heads[:, mask] == hdr[mask]).all(axis=1))
            if len(bad):
                first = int(bad[0])
                logger.warning(
                    "dropping L3 page %s: record format or namespace differs", keys[first][:16]
                )
                corrupt = 1
                self.storage.report_corrupt([keys[first]])
                good = first
        if good:
            self.host.scatter_payloads(host_pages[:good], table[:good, HEADER_BYTES:])
        return good, corrupt


def start_readers(readers: int, warm: Callable[[], Any]) -> ThreadPoolExecutor:
    """A pool of `readers` threads, all started now, each having run `warm` once (e.g. to
    allocate and touch its staging buffer)."""
    pool = ThreadPoolExecutor(readers, thread_name_prefix="hicache-read")
    gate = threading.Barrier(readers)  # holds every task until all have started: one per thread

    def start() -> None:
        gate.wait(timeout=30)
        warm()

    for f in [pool.submit(start) for _ in range(readers)]:
        f.result()
    return pool


def fetch_pipelined(
    op: Any,
    read: Callable[[Sequence[str], Sequence[int]], tuple[int, int]],
    pool: ThreadPoolExecutor,
    readers: int,
    sub: int,
    record_bytes: int,
) -> None:
    """Read `op` (a `PrefetchOp`) in sub-batches of `sub` pages, `readers` at once on `pool`
    (file reads and checksums release the GIL), accounted in order: `op.completed` only counts
    the leading run placed. Returns once no read of `op` is in flight."""
    n = len(op.keys)
    spans = [(i, min(i + sub, n)) for i in range(0, n, sub)]
    window: deque[tuple[int, int, Future[tuple[int, int]]]] = deque()
    nxt = 0

    def fill() -> None:
        nonlocal nxt
        while nxt < len(spans) and len(window) < readers and not op.stop.is_set():
            i, j = spans[nxt]
            window.append((i, j, pool.submit(read, op.keys[i:j], op.host_pages[i:j])))
            nxt += 1

    fill()
    try:
        while window:
            i, j, fut = window.popleft()
            good, corrupt = fut.result()
            op.corrupt += corrupt
            op.nbytes += good * record_bytes
            op.completed += good
            if good < j - i:
                break
            fill()
    finally:
        for _, _, fut in window:  # they write into this op's host pages: let them land
            fut.exception()
