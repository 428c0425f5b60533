"""Device <-> host page movement at copy-engine speed, with completion events.

`PageMover` moves whole pages between a `DeviceKVPool` and a `HostKVPool`:

- `io_backend="direct"`: one indexed copy on the device gathers the batch's pages into a
  contiguous staging buffer already in the host layout's page order (or scatters from it), and
  the staging buffer moves to/from the (pinned) host pool with one async copy per run of
  consecutive host pages (per run and layer half for `layer_first`, whose pages are not one
  block in host memory). No pageable temporaries: both sides of every host copy are contiguous.
- `io_backend="kernel"`: a Triton kernel (`hicache.transfer_kernel`) reads the device pool and
  writes the pinned host pool directly (and back) through unified addressing, page by page,
  one launch per batch (or per layer).

On CUDA, writes (device -> host) run on a dedicated write stream after waiting for the event
the submitter recorded on the compute stream, and loads (host -> device) on a dedicated load
stream; each returns CUDA events its owner polls (`query()`), never `synchronize()` on the
model's stream. A load can be layer-wise: one event per layer (`LayerDoneCounter`), so the
forward of layer i waits (on the device) for layer i only. On CPU the same code runs
synchronously with stand-in events that are complete at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any, Protocol

import numpy as np
import torch

from hicache.pools import DeviceKVPool, HostKVPool

logger = logging.getLogger(__name__)

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Upper bound of one staging buffer (bytes); bigger batches are moved in chunks.
STAGING_BYTES = 256 << 20


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class DoneEvent:
    """Stand-in for a CUDA event of work that ran synchronously (CPU)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


DONE = DoneEvent()


class LayerDoneCounter:
    """Completion of one (possibly layer-wise) host -> device load: an event per layer.

    `wait(layer)` makes the *current* stream wait (on the device, the host does not block) for
    that layer's pages; on CPU it returns at once. Hand `wait` to the forward as
    `ForwardBatch.wait_layer` so layer i waits for layer i only.
    """

    def __init__(self, events: Sequence[Event], num_layers: int) -> None:
        if len(events) not in (1, num_layers):
            raise ValueError(f"{len(events)} events for {num_layers} layers")
        self.events = list(events)
        self.num_layers = num_layers
        self._waited = [False] * len(self.events)

    def _event(self, layer: int) -> Event:
        return self.events[layer if len(self.events) > 1 else 0]

    def wait(self, layer: int) -> None:
        i = layer if len(self.events) > 1 else 0
        if self._waited[i]:
            return
        self._waited[i] = True
        ev = self.events[i]
        if isinstance(ev, torch.cuda.Event):
            torch.cuda.current_stream().wait_event(ev)

    def wait_all(self) -> None:
        for layer in range(len(self.events)):
            self.wait(layer)

    def done(self) -> bool:
        return all(e.query() for e in self.events)

    def synchronize(self) -> None:
        for e in self.events:
            e.synchronize()

    def query(self) -> bool:
        return self.done()


def merge_wait_layer(counters: Sequence[LayerDoneCounter]) -> Any:
    """One `wait_layer(i)` for a batch whose requests loaded pages (None when nothing loads)."""
    live = [c for c in counters if not c.done()] if counters else []
    if not live:
        return None

    def wait_layer(layer: int) -> None:
        for c in live:
            c.wait(layer)

    return wait_layer


def page_runs(pages: np.ndarray) -> list[tuple[int, int, int]]:
    """`(first_page, count, offset_in_batch)` for each run of consecutive page ids."""
    n = len(pages)
    if n == 0:
        return []
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [n]))
    return [(int(pages[s]), int(e - s), int(s)) for s, e in zip(starts, ends)]


class PageMover:
    """Moves pages between `device` and `host` (see the module docstring)."""

    def __init__(
        self, device: DeviceKVPool, host: HostKVPool, io_backend: str | None = None
    ) -> None:
        self.device = device
        self.host = host
        self.io_backend = io_backend or host.io_backend
        if self.io_backend not in ("direct", "kernel"):
            raise ValueError(f"unknown io_backend {self.io_backend!r}")
        self.cuda = device.device.type == "cuda"
        if device.mla != host.mla:
            raise ValueError("device and host pools differ in kind (MLA latent vs K/V)")
        L, ps, H, D = device.num_layers, device.page_size, device.kv_heads, device.head_dim
        self.num_layers = L
        self.planes = K = device.planes  # 2 (K and V) or 1 (the MLA latent)
        P = device.num_pages
        # The device pool and the host pool seen page by page in the host layout's order; the
        # page axis is `self.axis` in both. Elements move as same-width integers: bit-exact for
        # every dtype, and index kernels exist for all of them (not for fp8).
        self.bits = _INT_OF_SIZE[device.kv.element_size()]
        kv, hb = device.kv.view(self.bits), host.buffer.view(self.bits)
        dv = kv.view(K, L, P, ps, H, D)
        if host.layout == "layer_first":
            self.axis = 2
            self.dev_view = kv.view(K, L, P, ps * H * D)
            self.host_view = hb.view(K, L, host.num_pages, ps * H * D)
        elif host.layout == "page_first":
            self.axis = 0
            self.dev_view = dv.permute(2, 3, 0, 1, 4, 5)  # [P, ps, K, L, H, D]
            self.host_view = hb.view(host.num_pages, ps, K, L, H, D)
        else:
            self.axis = 0
            self.dev_view = dv.permute(2, 0, 1, 3, 4, 5)  # [P, K, L, ps, H, D]
            self.host_view = hb
        # The layer axis in those views (for layer-wise loads).
        self.layer_axis = {"layer_first": 1, "page_first": 3, "page_first_direct": 2}[host.layout]
        self.page_elems = host.page_nbytes // host.itemsize
        self.chunk_pages = max(1, STAGING_BYTES // host.page_nbytes)
        self._staging: dict[str, torch.Tensor] = {}
        self._locks = {"write": threading.Lock(), "load": threading.Lock()}
        self.write_stream: Any = None
        self.load_stream: Any = None
        if self.cuda:
            self.write_stream = torch.cuda.Stream(device.device)
            self.load_stream = torch.cuda.Stream(device.device)
        self._last_write: Event = DONE
        self._last_load: Event = DONE
        if self.io_backend == "kernel":
            from hicache import transfer_kernel

            if not self.cuda and not transfer_kernel.interpreted():
                # Nothing to move over UVA on CPU: the kernel runs there only under Triton's
                # interpreter (tests); otherwise the direct path moves the same bytes.
                logger.info("io_backend 'kernel' on CPU without TRITON_INTERPRET: using direct")
                self.io_backend = "direct"
            else:
                transfer_kernel.check_available(device.device)

    # -- helpers ----------------------------------------------------------------------------

    def _stage(self, kind: str, n: int) -> torch.Tensor:
        """A contiguous staging tensor for `n` pages, shaped like `host_view` with n pages."""
        need = n * self.page_elems
        buf = self._staging.get(kind)
        if buf is None or buf.numel() < need:
            buf = torch.empty(need, dtype=self.bits, device=self.device.device)
            self._staging[kind] = buf
        shape = list(self.host_view.shape)
        shape[self.axis] = n
        return buf[:need].view(shape)

    def _index(self, pages: Sequence[int] | np.ndarray) -> torch.Tensor:
        t = torch.as_tensor(pages, dtype=torch.int64)
        if not self.cuda:
            return t
        return t.pin_memory().to(self.device.device, non_blocking=True)

    def _host_copies(
        self, stage: torch.Tensor, host_pages: np.ndarray, to_host: bool, layer: int | None = None
    ) -> None:
        """Copy between `stage` and the host pool, one contiguous copy per run (and K/V half
        and layer for `layer_first`)."""
        ax = self.axis
        for first, count, off in page_runs(host_pages):
            h = self.host_view.narrow(ax, first, count)
            s = stage.narrow(ax, off, count)
            if ax == 0:
                pairs = [(h, s)]
            else:
                layers = range(self.num_layers) if layer is None else (layer,)
                pairs = [(h[kv, lyr], s[kv, lyr]) for kv in range(self.planes) for lyr in layers]
            for hh, ss in pairs:
                if to_host:
                    hh.copy_(ss, non_blocking=True)
                else:
                    ss.copy_(hh, non_blocking=True)

    def _streams(self, kind: str) -> Any:
        stream = self.write_stream if kind == "write" else self.load_stream
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def _record(self, kind: str) -> Event:
        if not self.cuda:
            return DONE
        ev = torch.cuda.Event()
        ev.record(self.write_stream if kind == "write" else self.load_stream)
        return ev

    # -- device -> host -----------------------------------------------------------------------

    def d2h(
        self, device_pages: Sequence[int], host_pages: Sequence[int], ready: Event | None = None
    ) -> Event:
        """Copy `device_pages` into `host_pages` (same order); returns the completion event.
        `ready`: an event recorded on the stream that produced the pages (CUDA)."""
        if len(device_pages) != len(host_pages):
            raise ValueError("device and host page lists differ in length")
        if not host_pages:
            return DONE
        caller = torch.cuda.current_stream(self.device.device) if self.cuda else None
        with self._locks["write"], self._streams("write"):
            if self.cuda:
                assert self.write_stream is not None
                if isinstance(ready, torch.cuda.Event):
                    self.write_stream.wait_event(ready)
                else:  # no event: wait for everything queued on the caller's stream so far
                    self.write_stream.wait_stream(caller)
                if isinstance(self._last_load, torch.cuda.Event):
                    self.write_stream.wait_event(self._last_load)  # host pages a load reads
            hp = np.asarray(host_pages, dtype=np.int64)
            for i in range(0, len(hp), self.chunk_pages):
                d_idx = self._index(device_pages[i : i + self.chunk_pages])
                h_chunk = hp[i : i + self.chunk_pages]
                if self.io_backend == "kernel":
                    from hicache.transfer_kernel import copy_pages

                    copy_pages(self.device, self.host, d_idx, self._index(h_chunk), to_host=True)
                    continue
                stage = self._stage("write", len(h_chunk))
                torch.index_select(self.dev_view, self.axis, d_idx, out=stage)
                self._host_copies(stage, h_chunk, to_host=True)
            ev = self._record("write")
            self._last_write = ev
            return ev

    # -- host -> device -----------------------------------------------------------------------

    def h2d(
        self, host_pages: Sequence[int], device_pages: Sequence[int], layerwise: bool = False
    ) -> LayerDoneCounter:
        """Copy `host_pages` into `device_pages`; with `layerwise`, one event per layer."""
        if len(device_pages) != len(host_pages):
            raise ValueError("device and host page lists differ in length")
        L = self.num_layers
        if not host_pages:
            return LayerDoneCounter([DONE], L)
        # The caller's (compute) stream, taken before the load stream becomes current.
        compute = torch.cuda.current_stream(self.device.device) if self.cuda else None
        with self._locks["load"], self._streams("load"):
            if self.cuda:
                assert self.load_stream is not None
                # The device pages may have been freed by work still queued on the compute
                # stream; host pages may still be arriving from a write.
                self.load_stream.wait_stream(compute)
                if isinstance(self._last_write, torch.cuda.Event):
                    self.load_stream.wait_event(self._last_write)
            hp = np.asarray(host_pages, dtype=np.int64)
            n = len(hp)
            one_chunk = n <= self.chunk_pages
            events: list[Event] = []
            if self.io_backend == "kernel" and one_chunk:
                from hicache.transfer_kernel import copy_pages

                d_idx, h_idx = self._index(device_pages), self._index(hp)
                if layerwise:
                    for layer in range(L):
                        copy_pages(self.device, self.host, d_idx, h_idx, to_host=False,
                                   layers=(layer, 1))
                        events.append(self._record("load"))
                else:
                    copy_pages(self.device, self.host, d_idx, h_idx, to_host=False)
            elif layerwise and one_chunk:
                d_idx = self._index(device_pages)
                stage = self._stage("load", n)
                if self.axis == 0:  # a page is one block: copy it whole, scatter layer by layer
                    self._host_copies(stage, hp, to_host=False)
                lax = self.layer_axis
                pax = self.axis - 1 if lax < self.axis else self.axis  # page axis of a layer
                for layer in range(L):
                    if self.axis != 0:
                        self._host_copies(stage, hp, to_host=False, layer=layer)
                    self.dev_view.select(lax, layer).index_copy_(
                        pax, d_idx, stage.select(lax, layer)
                    )
                    events.append(self._record("load"))
            else:
                for i in range(0, n, self.chunk_pages):
                    d_idx = self._index(device_pages[i : i + self.chunk_pages])
                    h_chunk = hp[i : i + self.chunk_pages]
                    if self.io_backend == "kernel":
                        from hicache.transfer_kernel import copy_pages

                        copy_pages(self.device, self.host, d_idx, self._index(h_chunk),
                                   to_host=False)
                        continue
                    stage = self._stage("load", len(h_chunk))
                    self._host_copies(stage, h_chunk, to_host=False)
                    self.dev_view.index_copy_(self.axis, d_idx, stage)
            if not events:
                events = [self._record("load")]
            self._last_load = events[-1]
            return LayerDoneCounter(events, L)

    # -- ordering with CPU-side users of host memory ------------------------------------------

    def host_quiet(self) -> None:
        """Block the calling (worker) thread until no copy in flight touches host memory:
        before L3 code reads pages a write is filling, or overwrites pages a load reads."""
        self._last_write.synchronize()
        self._last_load.synchronize()
