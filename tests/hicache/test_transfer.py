"""Device <-> host page transfers (`hicache.transfer.PageMover`) are bit-exact for every host
layout, io backend, dtype and batch shape; layer-wise loads equal whole loads.

CPU runs the `direct` path here and the Triton `kernel` under its interpreter in a subprocess;
the `gpu`-marked tests run both on CUDA (streams, events, pinned host memory)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hicache.pools import DeviceKVPool, HostKVPool
from hicache.transfer import DONE, LayerDoneCounter, PageMover, merge_wait_layer, page_runs

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn]
HAVE_CUDA = torch.cuda.is_available()


def random_kv(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Random bit patterns (every byte value, NaN/inf encodings included) of `dtype`."""
    g = torch.Generator().manual_seed(0)
    n = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).view(shape).to(device)


def pools(layout: str, dtype: torch.dtype, device: str, io: str = "direct"):
    dev = DeviceKVPool(num_pages=24, page_size=4, num_layers=3, kv_heads=2, head_dim=8,
                       dtype=dtype, device=device)
    dev.kv.copy_(random_kv(tuple(dev.kv.shape), dtype, device))
    host = HostKVPool.like(dev, 30, layout=layout, io_backend=io)
    return dev, host


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


# The batches: runs of consecutive host pages, scattered ones, a single page, and a reversed run.
CASES = [
    ([3, 1, 2, 7, 8, 9, 0], [5, 6, 7, 0, 1, 29, 3]),
    ([10, 11, 12, 13], [20, 21, 22, 23]),
    ([5], [0]),
    ([4, 6, 8, 15, 16, 17, 18, 19, 20, 23], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]),
]


def host_page_bits(host: HostKVPool, page: int) -> torch.Tensor:
    """A host page's KV as `[2, layers, page_size, heads, dim]` bytes, whatever the layout."""
    t = host.page_major[page]
    if host.layout == "page_first":
        t = t.permute(1, 2, 0, 3, 4)
    return bits(t)


def check_round_trip(layout: str, dtype: torch.dtype, device: str, io: str,
                     chunk_pages: int | None = None) -> None:
    dev, host = pools(layout, dtype, device, io)
    mover = PageMover(dev, host, io)
    if chunk_pages:
        mover.chunk_pages = chunk_pages
    original = dev.kv.clone()
    for dpages, hpages in CASES:
        ev = mover.d2h(dpages, hpages)
        ev.synchronize()
        assert ev.query()
        for d, h in zip(dpages, hpages):
            assert torch.equal(host_page_bits(host, h), bits(dev.page_tensor([d]))), (d, h)
        for layerwise in (False, True):
            targets = [p for p in range(24) if p not in dpages][: len(dpages)]
            dev.kv.zero_()
            ctr = mover.h2d(hpages, targets, layerwise=layerwise)
            ctr.wait_all()
            ctr.synchronize()
            assert ctr.done()
            got = bits(dev.kv[:, :, dev.slots(targets)])
            assert torch.equal(got, bits(original[:, :, dev.slots(dpages)]))
            # Nothing else on the device was written.
            others = [p for p in range(24) if p not in targets]
            assert not bits(dev.kv[:, :, dev.slots(others)]).any()
            dev.kv.copy_(original)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_direct_round_trip_is_bit_exact(layout, dtype):
    check_round_trip(layout, dtype, "cpu", "direct")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batches_bigger_than_the_staging_buffer_move_in_chunks(layout):
    check_round_trip(layout, torch.float32, "cpu", "direct", chunk_pages=3)


def test_kernel_on_cpu_without_interpreter_uses_direct(monkeypatch):
    # Triton decides interpreted-or-compiled when a kernel is decorated, i.e. when the module
    # is first imported: import it under the session's setting before flipping the variable,
    # or every later kernel test in this process would get a compiled kernel with no driver.
    importlib.import_module("hicache.transfer_kernel")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dev, host = pools("page_first", torch.float32, "cpu", "kernel")
    assert PageMover(dev, host).io_backend == "direct"


@pytest.mark.slow
def test_triton_kernel_round_trip_under_the_interpreter():
    pytest.importorskip("triton")
    code = (
        "import torch, tests.hicache.test_transfer as t\n"
        "for layout in t.LAYOUTS:\n"
        "    for dtype in (torch.float32, torch.bfloat16):\n"
        "        t.check_round_trip(layout, dtype, 'cpu', 'kernel')\n"
        "from hicache.transfer import PageMover\n"
        "d, h = t.pools('layer_first', torch.float32, 'cpu', 'kernel')\n"
        "assert PageMover(d, h).io_backend == 'kernel'\n"
        "print('kernel ok')\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "kernel ok" in r.stdout


def test_page_runs():
    import numpy as np

    assert page_runs(np.array([], dtype=np.int64)) == []
    assert page_runs(np.array([5, 6, 7, 0, 1, 9, 3])) == [(5, 3, 0), (0, 2, 3), (9, 1, 5),
                                                          (3, 1, 6)]
    assert page_runs(np.array([4, 3])) == [(4, 1, 0), (3, 1, 1)]


def test_layer_counter_on_cpu_completes_at_once():
    ctr = LayerDoneCounter([DONE] * 4, 4)
    assert ctr.done()
    for layer in range(4):
        ctr.wait(layer)
    with pytest.raises(ValueError):
        LayerDoneCounter([DONE] * 3, 4)
    assert merge_wait_layer([ctr]) is None  # nothing left to wait for
    assert merge_wait_layer([]) is None


def test_layerwise_forward_equals_whole_load():
    """A toy forward that reads layer i only after `wait(i)`: same result either way."""
    results = []
    for layerwise in (False, True):
        dev, host = pools("layer_first", torch.float32, "cpu")
        dev.kv.copy_(torch.randn(dev.kv.shape, generator=torch.Generator().manual_seed(1)))
        mover = PageMover(dev, host)
        src = [1, 2, 3, 4]
        mover.d2h(src, [7, 8, 9, 10]).synchronize()
        dev.kv[:, :, dev.slots(src)] = 0
        ctr = mover.h2d([7, 8, 9, 10], [11, 12, 13, 14], layerwise=layerwise)
        out = torch.zeros(())
        for layer in range(dev.num_layers):
            ctr.wait(layer)
            k, v = dev.get_kv(layer, dev.slots([11, 12, 13, 14]))
            out = out + (k.float() * 0.5 + v.float()).sum()
        results.append(out)
    assert torch.equal(results[0], results[1])


# -- CUDA (scripts/gpu_check.sh) --------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("io", ["direct", "kernel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_round_trip_is_bit_exact(layout, io, dtype):
    if io == "kernel":
        pytest.importorskip("triton")
    check_round_trip(layout, dtype, "cuda", io)
    check_round_trip(layout, dtype, "cuda", io, chunk_pages=3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA device")
def test_gpu_host_pool_is_pinned_and_copies_are_events():
    dev, host = pools("page_first_direct", torch.bfloat16, "cuda")
    assert host.buffer.is_pinned()
    mover = PageMover(dev, host)
    ev = mover.d2h([1, 2, 3], [4, 5, 6], ready=None)
    assert isinstance(ev, torch.cuda.Event)
    ev.synchronize()
    ctr = mover.h2d([4, 5, 6], [7, 8, 9], layerwise=True)
    assert len(ctr.events) == dev.num_layers
    assert all(isinstance(e, torch.cuda.Event) for e in ctr.events)
    ctr.wait_all()
    torch.cuda.current_stream().synchronize()
    assert torch.equal(bits(dev.kv[:, :, dev.slots([7, 8, 9])]),
                       bits(dev.kv[:, :, dev.slots([1, 2, 3])]))


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA device")
def test_gpu_layerwise_forward_waits_per_layer():
    """The compute stream reads each layer right after `wait(layer)`: equal to a whole load."""
    outs = []
    for layerwise in (False, True):
        dev, host = pools("layer_first", torch.float32, "cuda", "kernel")
        mover = PageMover(dev, host, "kernel" if transfer_kernel_ok() else "direct")
        mover.d2h([1, 2, 3, 4], [7, 8, 9, 10]).synchronize()
        expect = dev.kv[:, :, dev.slots([1, 2, 3, 4])].clone()
        ctr = mover.h2d([7, 8, 9, 10], [11, 12, 13, 14], layerwise=layerwise)
        got = []
        for layer in range(dev.num_layers):
            ctr.wait(layer)
            k, v = dev.get_kv(layer, dev.slots([11, 12, 13, 14]))
            got.append(torch.stack([k, v]).clone())
        torch.cuda.synchronize()
        # Bits, not floats: the pool holds random bit patterns, NaNs among them, and NaN != NaN
        # (torch.equal on the floats is False for a NaN even where every byte is in place).
        assert torch.equal(bits(torch.stack(got, 1)), bits(expect))
        outs.append(bits(torch.stack(got, 1)))
    assert torch.equal(outs[0], outs[1])


def transfer_kernel_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
