"""Layer-wise load-back through a real model forward: the runner calls `wait_layer(i)` (the
`LayerDoneCounter` of a layer-wise host -> device load) before layer i reads the pool; the
logits equal those of a whole load and of the original device copy. On CPU the counter
completes at once; the `gpu` variant overlaps the load stream with the forward."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine

PAGE = 4


def cached_chain(cache, tokens):
    """Device and host pages of the cached prefix of `tokens` (every node on both tiers)."""
    node = cache.match_prefix(tokens).last_device_node
    chain = []
    while node.parent is not None:
        chain.append(node)
        node = node.parent
    chain.reverse()
    return ([p for x in chain for p in x.value], [p for x in chain for p in x.host_value])


def logits_three_ways(device: str) -> list[torch.Tensor]:
    with Engine(page_size=PAGE, max_total_tokens=1024, enable_hierarchical_cache=True,
                hicache_synchronous=True, device=device, dtype="float32") as eng:
        prompt = [(7 * i) % 200 + 10 for i in range(64)]
        tail = [11, 12, 13, 14, 15, 16, 17, 18]
        eng.generate(input_ids=prompt + [5], sampling_params={"max_new_tokens": 1})
        eng.wait_transfers()
        cache, runner = eng.cache, eng.runner
        dev_pages, host_pages = cached_chain(cache, prompt)
        assert len(dev_pages) == len(host_pages) == len(prompt) // PAGE
        out = []
        for mode in ("device", "whole", "layerwise"):
            tail_pages = cache.alloc_device(len(tail) // PAGE)
            pages = dev_pages
            fresh: list[int] = []
            wait = None
            if mode != "device":
                fresh = cache.alloc_device(len(host_pages))
                runner.pool.kv[:, :, runner.pool.slots(fresh)] = 0
                ctr = cache.controller.load(host_pages, fresh, layerwise=mode == "layerwise")
                # A whole load has one event: the forward waits for it before layer 0 (on CUDA
                # the load runs on its own stream; without the wait layer 0 could read zeros).
                waited: list[int] = []

                def wait(layer: int, ctr=ctr, waited=waited) -> None:
                    waited.append(layer)
                    ctr.wait(layer)

                pages = fresh
                assert len(ctr.events) == (runner.pool.num_layers if mode == "layerwise" else 1)
            logits = runner.forward([(tail, len(prompt), pages + tail_pages)], wait_layer=wait)
            if mode != "device":
                assert waited == list(range(runner.pool.num_layers))
            out.append(logits.float().cpu())
            cache.free_device(tail_pages + fresh)
        return out


def test_layerwise_load_gives_the_same_logits():
    device, whole, layerwise = logits_three_ways("cpu")
    assert torch.equal(whole, device)
    assert torch.equal(layerwise, device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_layerwise_load_gives_the_same_logits():
    device, whole, layerwise = logits_three_ways("cuda")
    assert torch.equal(whole, device)
    assert torch.equal(layerwise, device)
