"""Stream ordering made provable (issue 29): every copy `PageMover` queues on its write and load
streams is held back on purpose (`torch.cuda._sleep` queued on the side stream before the
copies), so that a reader that does not wait for a copy sees the wrong bytes *every* time, not
once in a while. Each test first shows that (a control that skips the wait and must see the
stale bytes), then that the real wait gives the right ones, bit for bit:

- a forward that reads layer i right after `wait(i)` (layer-wise and whole loads);
- host pages a CPU reader (L3 backup) reads after a device -> host write (`host_quiet`);
- host pages a CPU writer (L3 prefetch) reuses while a load still reads them (`host_quiet`);
- many loads queued back to back, whose index and staging temporaries are freed and reused
  while earlier copies still wait on the stream;
- the whole tiered cache (device -> host -> L3 -> host -> device) with every copy slowed.

Run over every host layout x io backend (x layer-wise on/off). CUDA only: on CPU every copy
completes when it is issued, so there is nothing to order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.pools import DeviceKVPool, HostKVPool
from hicache.transfer import PageMover
from tests.hicache.test_transfer import bits, random_kv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
IOS = ["direct", "kernel"]
# About 10-20 ms of GPU time queued before each batch of copies: far longer than the host needs
# to queue the reads below, so an unordered read always runs first.
SLOW_CYCLES = 30_000_000
SENTINEL = 0x5A  # the byte a page holds before the copy that should fill it lands
# Every host layout x io backend x layer-wise load or whole.
EVERY_LOAD = pytest.mark.parametrize(
    ("layout", "io", "layerwise"), list(itertools.product(LAYOUTS, IOS, [True, False])))


@contextmanager
def slowed_streams(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Queue `torch.cuda._sleep(SLOW_CYCLES)` on the side stream each time `PageMover` makes it
    current, before the copies; yields the kinds slowed, in order."""
    original = PageMover._streams
    slowed: list[str] = []

    @contextmanager
    def slow(self: PageMover, kind: str) -> Iterator[None]:
        with original(self, kind):
            torch.cuda._sleep(SLOW_CYCLES)
            slowed.append(kind)
            yield

    monkeypatch.setattr(PageMover, "_streams", slow)
    yield slowed


def pools(layout: str, io: str, dtype: torch.dtype = torch.bfloat16) -> tuple[Any, Any, PageMover]:
    if io == "kernel":
        pytest.importorskip("triton")
    dev = DeviceKVPool(num_pages=24, page_size=4, num_layers=3, kv_heads=2, head_dim=8,
                       dtype=dtype, device="cuda")
    dev.kv.copy_(random_kv(tuple(dev.kv.shape), dtype, "cuda"))
    host = HostKVPool.like(dev, 30, layout=layout, io_backend=io)
    assert host.buffer.is_pinned()
    return dev, host, PageMover(dev, host, io)


def dev_bits(dev: DeviceKVPool, pages: list[int]) -> torch.Tensor:
    """A device-side copy of `pages`' bytes, queued on the current stream (no host sync)."""
    return dev.kv[:, :, dev.slots(pages)].contiguous().view(torch.uint8).clone()


def fill_sentinel(t: torch.Tensor) -> None:
    t.view(torch.uint8).fill_(SENTINEL)


@EVERY_LOAD
def test_forward_reads_each_layer_only_after_its_slowed_load(
    monkeypatch: pytest.MonkeyPatch, layout: str, io: str, layerwise: bool
) -> None:
    dev, host, mover = pools(layout, io)
    src, hp, dst = [1, 2, 3, 4, 9], [7, 8, 9, 10, 20], [11, 12, 13, 14, 5]
    mover.d2h(src, hp).synchronize()
    expect = bits(dev.kv[:, :, dev.slots(src)])
    with slowed_streams(monkeypatch) as slowed:
        for waits in (False, True):
            fill_sentinel(dev.kv[:, :, dev.slots(dst)])
            ctr = mover.h2d(hp, dst, layerwise=layerwise)
            assert len(ctr.events) == (dev.num_layers if layerwise else 1)
            got = []
            for layer in range(dev.num_layers):
                if waits:
                    ctr.wait(layer)
                k, v = dev.get_kv(layer, dev.slots(dst))
                got.append(torch.stack([k, v]).contiguous().view(torch.uint8).clone())
            torch.cuda.synchronize()
            seen = torch.stack(got, 1).cpu()
            if waits:
                assert torch.equal(seen, expect.view(seen.shape))
            else:  # the control: the slowed load had not landed when the reads ran
                assert torch.equal(seen, torch.full_like(seen, SENTINEL))
    assert slowed == ["load", "load"]  # both loads slowed (the d2h ran before)


@pytest.mark.parametrize("io", IOS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_reader_after_a_slowed_write_waits_for_it(
    monkeypatch: pytest.MonkeyPatch, layout: str, io: str
) -> None:
    """An L3 backup reads host pages on the CPU (`TensorTransfer.store`): after `host_quiet`
    they hold what the device -> host write put there, never the bytes from before."""
    dev, host, mover = pools(layout, io)
    src, hp = [2, 3, 5], [4, 11, 12]
    expect = bits(dev.kv[:, :, dev.slots(src)])
    out = torch.empty((len(hp), host.page_nbytes), dtype=torch.uint8)
    with slowed_streams(monkeypatch):
        for quiet in (False, True):
            fill_sentinel(host.buffer)
            mover.d2h(src, hp)
            if quiet:
                mover.host_quiet()
            host.gather_payloads(hp, out)  # what store() encodes into records
            if quiet:
                torch.cuda.synchronize()
                back = torch.empty_like(out)
                host.gather_payloads(hp, back)
                assert torch.equal(out, back)  # nothing changed after the wait
                dev.kv[:, :, dev.slots([20, 21, 22])] = 0
                mover.h2d(hp, [20, 21, 22]).synchronize()
                assert torch.equal(bits(dev.kv[:, :, dev.slots([20, 21, 22])]), expect)
            else:
                assert torch.equal(out, torch.full_like(out, SENTINEL))
            torch.cuda.synchronize()


@pytest.mark.parametrize("io", IOS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_pages_reused_while_a_slowed_load_reads_them(
    monkeypatch: pytest.MonkeyPatch, layout: str, io: str
) -> None:
    """An L3 prefetch overwrites freed host pages on the CPU (`TensorTransfer.read_batch`):
    after `host_quiet` a load still reading them has finished, so it delivers the old bytes."""
    dev, host, mover = pools(layout, io)
    src, hp, dst = [1, 2, 3], [5, 6, 7], [15, 16, 17]
    mover.d2h(src, hp).synchronize()
    old = bits(dev.kv[:, :, dev.slots(src)])
    new = torch.full((len(hp), host.page_nbytes), 0x33, dtype=torch.uint8)
    with slowed_streams(monkeypatch):
        for quiet in (False, True):
            mover.d2h(src, hp).synchronize()  # the old bytes again
            fill_sentinel(dev.kv[:, :, dev.slots(dst)])
            mover.h2d(hp, dst)
            if quiet:
                mover.host_quiet()
            host.scatter_payloads(hp, new)  # what read_batch places
            torch.cuda.synchronize()
            got = bits(dev.kv[:, :, dev.slots(dst)])
            if quiet:
                assert torch.equal(got, old)
            else:  # the control: the load read the pages after the CPU rewrote them
                assert torch.equal(got, torch.full_like(got, 0x33))


@EVERY_LOAD
def test_back_to_back_slowed_copies_keep_their_temporaries(
    monkeypatch: pytest.MonkeyPatch, layout: str, io: str, layerwise: bool
) -> None:
    """Eight writes then eight loads queued at once on slowed streams, each with its own page
    lists: the pinned index copies, device index tensors and staging buffers of one call are
    freed (or reused) by the host while its copies still wait; each must still move its own
    pages. Then a big batch that grows the staging buffer behind queued smaller ones."""
    dev, host, mover = pools(layout, io)
    batches = [([i, 23 - i], [2 * i, 2 * i + 1]) for i in range(8)]
    expect = {h: bits(dev.kv[:, :, dev.slots([d])]) for d_pages, h_pages in batches
              for d, h in zip(d_pages, h_pages)}
    with slowed_streams(monkeypatch):
        fill_sentinel(host.buffer)
        for d_pages, h_pages in batches:
            written = mover.d2h(d_pages, h_pages)
        # The device pages are overwritten only once the writes read them (the cache keeps a
        # written node locked until its ack); a device-side wait, the host goes on.
        torch.cuda.current_stream().wait_event(written)
        fill_sentinel(dev.kv)
        ctrs = [mover.h2d(h_pages, h_pages, layerwise=layerwise) for _, h_pages in batches]
        for c in ctrs:
            c.wait_all()
        got = {h: dev_bits(dev, [h]) for _, h_pages in batches for h in h_pages}
        torch.cuda.synchronize()
    for h, want in expect.items():
        assert torch.equal(got[h].cpu(), want), h
    # A load larger than any before (a new, bigger staging buffer) behind queued small ones.
    with slowed_streams(monkeypatch):
        mover.h2d([0], [20])
        big = list(range(16))
        fill_sentinel(dev.kv[:, :, dev.slots([4, 5])])
        ctr = mover.h2d(big, [16, 17, 18, 19, 20, 21, 22, 23, 0, 1, 2, 3, 4, 5, 6, 7],
                        layerwise=layerwise)
        ctr.wait_all()
        tail = dev_bits(dev, [4, 5])
        torch.cuda.synchronize()
    assert torch.equal(tail.cpu(), torch.cat([expect[12], expect[13]], dim=2))


@pytest.mark.parametrize("storage", ["memory", "file"])
@pytest.mark.parametrize("io", IOS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_tiers_bit_exact_with_every_copy_slowed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, layout: str, io: str, storage: str
) -> None:
    """The tiered cache's round trip (device -> host -> L3 -> host -> device) on threads, with
    every device <-> host copy held back: the pages come back bit for bit."""
    from tests.hicache.test_roundtrip import check_all_tiers, cuda_cache

    if io == "kernel":
        pytest.importorskip("triton")
    extra = {"path": str(tmp_path / "pages")} if storage == "file" else None
    with slowed_streams(monkeypatch) as slowed:
        cache = cuda_cache(layout, io, torch.bfloat16, False, f"slow-{layout}-{io}", storage,
                           extra)
        check_all_tiers(cache, torch.bfloat16)
    assert "write" in slowed and "load" in slowed
