"""`ProbingTransfer` forwards return values, extra arguments and every capability `Transfer`
declares to the transfer it wraps (a layer-wise load through it yields the inner transfer's
per-layer counter)."""

from __future__ import annotations

import torch

from hicache.ops import Transfer
from hicache.prefetch import ProbingTransfer
from hicache.transfer import LayerDoneCounter
from tests.hicache.factories import tensor_cache


def test_probing_transfer_passes_arguments_and_results_through():
    cache = tensor_cache(synchronous=True)
    probing = cache.controller.transfer
    assert isinstance(probing, ProbingTransfer)
    inner = probing.inner
    dev, host = cache.alloc_device(2), cache.alloc_host(2)
    assert dev is not None and host is not None
    pool = cache.device_pool
    pool.kv[:, :, pool.slots(dev)] = torch.randn(pool.kv[:, :, pool.slots(dev)].shape)
    want = pool.kv[:, :, pool.slots(dev)].clone()
    probing.device_to_host(dev, host)
    cache.controller.wait_idle()
    pool.kv[:, :, pool.slots(dev)] = 0
    ctr = probing.host_to_device(host, dev, True)  # layerwise, positionally
    assert isinstance(ctr, LayerDoneCounter)
    assert ctr.num_layers == pool.num_layers
    ctr.wait_all()
    assert torch.equal(pool.kv[:, :, pool.slots(dev)], want)
    assert probing.bytes_per_token == inner.bytes_per_token
    cache.close()


def test_probing_transfer_forwards_every_declared_member():
    """A member `Transfer` declares with a default and `ProbingTransfer` did not forward would
    answer the default (no pipelined reads, no cost model) instead of the inner transfer's."""
    facts = ("bytes_per_token", "page_size", "record_bytes", "pipelined_reads")
    members = [n for n in vars(Transfer) if not n.startswith("_")]
    assert {*facts, "read_batch", "warm_staging", "ready_event", "quiet_host", "device_to_host",
            "host_to_device", "exists", "store", "fetch"} == set(members)
    # Methods are forwarded by the class, the four facts are the wrapper's own copies.
    assert [n for n in members if n not in facts and n not in vars(ProbingTransfer)] == []
    cache = tensor_cache(synchronous=True)
    probing = cache.controller.transfer
    assert isinstance(probing, ProbingTransfer)
    assert [n for n in facts if n not in vars(probing)] == []
    for name in facts:
        assert getattr(probing, name) == getattr(probing.inner, name), name
    assert probing.pipelined_reads is True
    assert probing.page_size == cache.page_size
    cache.close()
