"""`io_backend="kernel"`: a Triton kernel that moves KV pages between the device pool and the
host pool directly.

On CUDA the host pool is pinned memory, which a kernel can read and write through unified
virtual addressing: one launch moves a whole batch of scattered pages (or one layer of them)
with no staging buffer and no per-page host work. On CPU the kernel runs under Triton's
interpreter (`TRITON_INTERPRET=1`, set before `hicache` is imported), which is how the tests
check it bit for bit without a GPU.

Every layout is described by three strides (elements) of the same unit, a *row* of
`kv_heads * head_dim` contiguous elements: `page` (next page), `chunk` (next K/V-and-layer,
`kv * layers + layer`) and `token` (next token of the page). Each program copies one
(page, K/V, layer) block of `page_size` rows. An MLA pool has one plane (the latent) where a
K/V pool has two; the strides say so and the grid has one chunk per layer. Elements move as same-width integers, so every
dtype (bf16, fp8) is copied bit-exactly.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from hicache.pools import DeviceKVPool, HostKVPool
from hicache_client.errors import ConfigError

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_TRITON = False

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# Triton's interpreter keeps the launch grid in one process-wide object: two threads launching
# at once (the controller's write and load workers) corrupt each other's grid. Compiled (CUDA)
# launches are serialized too: the first launch of a specialization compiles and loads the
# kernel, and Triton's JIT caches are not made for two threads doing that at once; a launch
# only enqueues, so the lock is held for microseconds.
_LAUNCH_LOCK = threading.Lock()


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_available(device: torch.device) -> None:
    """Raise `ConfigError` when the kernel cannot run for a pool on `device`."""
    if not HAVE_TRITON:
        raise ConfigError("io_backend 'kernel' needs triton (pip install triton)")
    if device.type == "cuda":
        return
    if not interpreted():
        raise ConfigError(
            "io_backend 'kernel' on CPU runs only under Triton's interpreter "
            "(TRITON_INTERPRET=1 before start); use io_backend 'direct'"
        )


if HAVE_TRITON:

    @triton.jit
    def _copy_pages_kernel(  # type: ignore[no-untyped-def]
        src,
        dst,
        src_pages,
        dst_pages,
        layer_lo,
        n_layers,
        num_layers,
        s_page,
        s_chunk,
        s_tok,
        d_page,
        d_chunk,
        d_tok,
        PS: tl.constexpr,
        ROW: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        i = tl.program_id(0)
        c = tl.program_id(1)
        kv = c // n_layers
        layer = layer_lo + c % n_layers
        chunk = (kv * num_layers + layer).to(tl.int64)
        sp = tl.load(src_pages + i).to(tl.int64)
        dp = tl.load(dst_pages + i).to(tl.int64)
        s_base = sp * s_page + chunk * s_chunk
        d_base = dp * d_page + chunk * d_chunk
        for t0 in range(0, PS, BLOCK_T):
            t = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
            for r0 in range(0, ROW, BLOCK_R):
                r = r0 + tl.arange(0, BLOCK_R)
                m = (t[:, None] < PS) & (r[None, :] < ROW)
                x = tl.load(src + s_base + t[:, None] * s_tok + r[None, :], mask=m)
                tl.store(dst + d_base + t[:, None] * d_tok + r[None, :], x, mask=m)


def strides(pool: DeviceKVPool | HostKVPool) -> tuple[int, int, int]:
    """(page, chunk, token) strides in rows' elements of `pool`'s layout."""
    L, ps, K = pool.num_layers, pool.page_size, pool.planes
    row = pool.kv_heads * pool.head_dim
    slots = pool.num_pages * ps
    layout = "layer_first" if isinstance(pool, DeviceKVPool) else pool.layout
    if layout == "layer_first":
        return ps * row, slots * row, row
    if layout == "page_first":
        return ps * K * L * row, row, K * L * row
    return K * L * ps * row, ps * row, row  # page_first_direct


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(_INT_OF_SIZE[t.element_size()])


def copy_pages(
    device: DeviceKVPool,
    host: HostKVPool,
    device_pages: torch.Tensor,
    host_pages: torch.Tensor,
    *,
    to_host: bool,
    layers: tuple[int, int] | None = None,
) -> None:
    """Copy pages (same order) device -> host (`to_host`) or host -> device, all layers or
    `layers=(first, count)`; one launch on the current stream."""
    n = int(device_pages.numel())
    if n == 0:
        return
    L = device.num_layers
    if device.planes != host.planes:
        raise ValueError("device and host pools differ in kind (MLA latent vs K/V)")
    lo, count = layers if layers is not None else (0, L)
    row = device.kv_heads * device.head_dim
    dev_s, host_s = strides(device), strides(host)
    dev_t, host_t = _flat(device.kv), _flat(host.buffer)
    if to_host:
        src, dst, sp, dp, ss, ds = dev_t, host_t, device_pages, host_pages, dev_s, host_s
    else:
        src, dst, sp, dp, ss, ds = host_t, dev_t, host_pages, device_pages, host_s, dev_s
    ps = device.page_size
    block_r = min(triton.next_power_of_2(row), 1024)
    block_t = max(1, min(triton.next_power_of_2(ps), 4096 // block_r))
    grid = (n, device.planes * count)
    args: list[Any] = [src, dst, sp, dp, lo, count, L, *ss, *ds]
    with _LAUNCH_LOCK:
        _copy_pages_kernel[grid](*args, PS=ps, ROW=row, BLOCK_T=block_t, BLOCK_R=block_r)
