"""`ProbingTransfer` forwards return values, extra arguments and attributes to the transfer it
wraps (a layer-wise load through it yields the inner transfer's per-layer counter)."""

from __future__ import annotations

import torch

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
