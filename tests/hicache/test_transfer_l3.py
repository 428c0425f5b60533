"""host <-> L3 in batches (`hicache.transfer_tensor.TensorTransfer`): records read into one
staging buffer, headers checked together, payloads placed with one indexed copy per batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hicache.controller import PrefetchOp, TransferController
from hicache.memory_backend import MemoryBackend
from hicache.pools import DeviceKVPool, HostKVPool, dtype_name
from hicache.transfer_tensor import TensorTransfer
from hicache_client.backend import StorageConfig
from hicache_client.codec import PageCodec

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def setup(layout: str, dtype: torch.dtype, shared: str, namespace: bytes = b"n" * 32):
    dev = DeviceKVPool(num_pages=8, page_size=4, num_layers=2, kv_heads=2, head_dim=4,
                       dtype=dtype)
    dev.kv.copy_(torch.randn(dev.kv.shape).to(dtype))
    host = HostKVPool.like(dev, 16, layout=layout)
    codec = PageCodec(namespace=namespace, dtype=dtype_name(dtype), shape=host.page_shape,
                      layout=layout, tokens_per_page=4, itemsize=host.itemsize)
    backend = MemoryBackend(StorageConfig(extra={"shared": shared}))
    return dev, host, TensorTransfer(dev, host, backend, codec), backend


def counters() -> SimpleNamespace:
    return SimpleNamespace(written=0, failed=0, nbytes=0, completed=0, corrupt=0)


def forty_stored_pages(shared: str):
    """40 pages (device pages 0-39 -> host pages 0-39) stored in L3; host pages 50-89 are free."""
    dev = DeviceKVPool(num_pages=48, page_size=2, num_layers=2, kv_heads=1, head_dim=4)
    dev.kv.copy_(torch.randn(dev.kv.shape))
    host = HostKVPool.like(dev, 96, layout="page_first")
    codec = PageCodec(namespace=b"n" * 32, dtype="float32", shape=host.page_shape,
                      layout="page_first", tokens_per_page=2, itemsize=4)
    tr = TensorTransfer(dev, host, MemoryBackend(StorageConfig(extra={"shared": shared})), codec)
    keys = [f"p{i}" for i in range(40)]
    tr.device_to_host(list(range(40)), list(range(40)))
    tr.store(keys, list(range(40)), counters())
    return host, codec, tr, keys


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_then_fetch_in_batches_is_bit_exact(layout, dtype):
    dev, host, tr, _ = setup(layout, dtype, f"l3-{layout}-{dtype}")
    keys = [f"k{i}" for i in range(6)]
    tr.device_to_host([0, 1, 2, 3, 4, 5], [9, 3, 4, 5, 12, 0]).synchronize()
    op = counters()
    tr.store(keys, [9, 3, 4, 5, 12, 0], op)
    assert (op.written, op.failed, op.nbytes) == (6, 0, 6 * tr.codec.record_bytes)
    expect = host.page_major[[9, 3, 4, 5, 12, 0]].clone()
    host.buffer.zero_()
    op = counters()
    assert tr.fetch(keys[:4], [1, 2, 7, 6], op) and tr.fetch(keys[4:], [15, 8], op)
    assert (op.completed, op.corrupt, op.nbytes) == (6, 0, 6 * tr.codec.record_bytes)
    assert torch.equal(host.page_major[[1, 2, 7, 6, 15, 8]].view(torch.uint8),
                       expect.view(torch.uint8))


def test_fetch_stops_at_a_record_of_another_namespace():
    dev, host, tr, backend = setup("page_first", torch.float32, "l3-foreign")
    keys = [f"k{i}" for i in range(5)]
    tr.device_to_host([0, 1, 2, 3, 4], [0, 1, 2, 3, 4])
    tr.store(keys, [0, 1, 2, 3, 4], counters())
    # Same key, valid checksum, but written by another cache (another namespace).
    _, _, other, _ = setup("page_first", torch.float32, "l3-foreign", namespace=b"x" * 32)
    other.store([keys[2]], [7], counters())
    expect = host.page_major[[0, 1]].clone()
    host.buffer.zero_()
    op = counters()
    assert not tr.fetch(keys, [10, 11, 12, 13, 14], op)
    assert (op.completed, op.corrupt) == (2, 1)
    assert backend.stats().corrupt_pages == 1
    assert torch.equal(host.page_major[[10, 11]], expect)  # placed
    assert not host.page_major[12].any()  # the foreign page was not placed


def test_missing_page_stops_the_fetch():
    _, host, tr, _ = setup("layer_first", torch.float32, "l3-missing")
    tr.device_to_host([0, 1], [0, 1])
    tr.store(["a", "b"], [0, 1], counters())
    op = counters()
    assert not tr.fetch(["a", "zz", "b"], [2, 3, 4], op)
    assert (op.completed, op.corrupt) == (1, 0)


def test_prefetch_worker_acks_and_wakes_waiters():
    dev, host, tr, _ = setup("page_first_direct", torch.float32, "l3-worker")
    keys = [f"k{i}" for i in range(7)]
    tr.device_to_host(list(range(7)), list(range(7)))
    tr.store(keys, list(range(7)), counters())
    ctl = TransferController(tr, has_storage=True, batch_pages=3)
    try:
        op = PrefetchOp("r", anchor=None, tokens=(), start_page=0, keys=keys,  # type: ignore[arg-type]
                        host_pages=[8, 9, 10, 11, 12, 13, 14], started=0.0, budget_s=0.0)
        ctl.submit_prefetch(op)
        while not ctl.wait_progress(60):
            pass
        assert ctl.wait_idle(60)
        assert ctl.acks() == [op]
        assert (op.completed, op.error) == (7, None)
        assert torch.equal(host.page_major[8:15], host.page_major[0:7])
        assert not ctl.wait_progress(0)  # nothing pending, nothing queued
        assert ctl.cost is not None and ctl.cost.bandwidth["storage"].value > 0
    finally:
        ctl.close()


def test_pipelined_prefetch_counts_the_leading_run_only():
    """40 pages read as sub-batches on reader threads; a page missing in the second sub-batch
    stops the count there, whatever order the readers finished in."""
    host, codec, tr, keys = forty_stored_pages("l3-pipe")
    ctl = TransferController(tr, has_storage=True, batch_pages=128, readers=4)
    try:
        full = PrefetchOp("a", anchor=None, tokens=(), start_page=0, keys=keys,  # type: ignore[arg-type]
                          host_pages=list(range(50, 90)), started=0.0, budget_s=0.0)
        holed = PrefetchOp("b", anchor=None, tokens=(), start_page=0,  # type: ignore[arg-type]
                           keys=keys[:20] + ["missing"] + keys[21:],
                           host_pages=list(range(50, 90)), started=0.0, budget_s=0.0)
        ctl.submit_prefetch(full)
        assert ctl.wait_idle(60)
        # Done, but its ack not yet handed out: still pending for the owner (flush and the
        # engine's `pending_transfers` would otherwise see an idle cache with an ack unapplied).
        assert ctl.pending == 1
        assert (full.completed, full.nbytes) == (40, 40 * codec.record_bytes)
        assert torch.equal(host.page_major[50:90], host.page_major[0:40])
        ctl.submit_prefetch(holed)
        assert ctl.wait_idle(60)
        assert (holed.completed, holed.error) == (20, None)
        assert ctl.pending == 2
        assert ctl.acks() == [full, holed]
        assert ctl.pending == 0
    finally:
        ctl.close()


def test_readers_start_with_the_controller_and_a_prefetch_starts_no_thread():
    """A restarted engine's first L3 hit pays for no thread start or fresh staging memory: the
    controller starts its readers, each with a touched staging buffer, when it is created."""
    import threading

    from hicache.controller import MIN_READ_PAGES

    host, codec, tr, keys = forty_stored_pages("l3-warm")
    before = {t.ident for t in threading.enumerate()}  # (other tests' threads are not ours)
    ctl = TransferController(tr, has_storage=True, batch_pages=128, readers=3)
    try:
        readers = {t.ident for t in threading.enumerate()
                   if t.name.startswith("hicache-read") and t.ident not in before}
        assert len(readers) == 3
        sizes = ctl._reader_pool.map(lambda _: tr._local.tensor.numel(), range(9))
        assert set(sizes) == {MIN_READ_PAGES * codec.record_bytes}
        op = PrefetchOp("a", anchor=None, tokens=(), start_page=0, keys=keys,  # type: ignore[arg-type]
                        host_pages=list(range(50, 90)), started=0.0, budget_s=0.0)
        ctl.submit_prefetch(op)
        assert ctl.wait_idle(60)
        assert op.completed == 40
        assert torch.equal(host.page_major[50:90], host.page_major[0:40])
        after = {t.ident for t in threading.enumerate()
                 if t.name.startswith("hicache-read") and t.ident not in before}
        assert after == readers
    finally:
        ctl.close()
    unstarted = TransferController(tr, has_storage=False, readers=3)  # no L3: no readers
    try:
        assert unstarted._reader_pool is None
    finally:
        unstarted.close()
