"""CUDA graphs of the decode step: the CPU-side logic (batch-size ladder, padding, the static
buffers) on any machine, the padded static batch through the triton kernels (interpreter on CPU),
and the capture itself on CUDA only (`gpu`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.attention import ForwardBatch
from engine.cuda_graph import DecodeGraphInputs, batch_size_ladder, padded_batch_size

CUDA = torch.cuda.is_available()


def test_ladder() -> None:
    assert batch_size_ladder(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_size_ladder(20) == [1, 2, 4, 8, 16, 20]
    assert batch_size_ladder(200) == [1, 2, 4, 8, 16, 32, 64, 128, 192, 200]
    assert batch_size_ladder(1) == [1]
    assert batch_size_ladder(0) == []


def test_padded_batch_size() -> None:
    ladder = batch_size_ladder(48)
    got = {n: padded_batch_size(ladder, n) for n in (1, 2, 3, 5, 16, 17, 33, 48, 49)}
    assert got == {1: 1, 2: 2, 3: 4, 5: 8, 16: 16, 17: 32, 33: 48, 48: 48, 49: None}


def _decode_batch(pool_pages: int = 32) -> tuple[ForwardBatch, object]:
    from hicache.pools import DeviceKVPool

    pool = DeviceKVPool(num_pages=pool_pages, page_size=4, num_layers=1, kv_heads=1, head_dim=4)
    seqs = [([5], 6, [3, 9]), ([7], 0, [12]), ([8], 9, [1, 2, 30])]
    return ForwardBatch.build(pool, seqs), pool


def test_fill_copies_rows_and_pads() -> None:
    batch, _ = _decode_batch()
    inp = DecodeGraphInputs(max_bs=8, max_pages=4, page_size=4, device=torch.device("cpu"))
    inp.page_table.fill_(99)  # stale contents of an earlier, wider step
    inp.out_slots[:8] = 123
    inp.fill(batch, 4)
    assert inp.input_ids[:4].tolist() == [5, 7, 8, 0]
    assert inp.positions[:4].tolist() == [6, 0, 9, 0]
    assert inp.out_slots[:5].tolist() == [9 * 4 + 2, 48, 30 * 4 + 1, -1, 123]  # row 4: unused
    assert inp.kv_lens[:4].tolist() == [7, 1, 10, 1]
    assert inp.page_table[:4].tolist() == [[3, 9, 0, 99], [12, 0, 0, 99], [1, 2, 30, 99],
                                           [0, 99, 99, 99]]
    b = inp.batch(4)
    assert b.is_decode and b.batch_size == 4 and b.logits_rows is None
    assert b.q_starts.tolist() == [0, 1, 2, 3, 4]
    assert b.input_ids.data_ptr() == inp.input_ids.data_ptr()  # views: the graph's inputs
    assert inp.fits(batch)
    narrow = DecodeGraphInputs(max_bs=2, max_pages=4, page_size=4, device=torch.device("cpu"))
    assert not narrow.fits(batch)  # too many requests: runs eagerly
    short = DecodeGraphInputs(max_bs=8, max_pages=2, page_size=4, device=torch.device("cpu"))
    assert not short.fits(batch)  # page table wider than the graphs'


def test_padded_static_batch_equals_eager(checkpoint_factory: Callable[..., Path]) -> None:
    """What a replay computes: the model over the padded static buffers gives the eager logits
    for the real rows and writes K/V only to the real rows' slots (triton kernels)."""
    pytest.importorskip("triton", reason="needs the triton package")  # interpreted: conftest
    from engine.model_runner import ModelRunner
    from engine.models import load_model

    dev = torch.device("cuda" if CUDA else "cpu")
    path = checkpoint_factory("llama", with_tokenizer=False, layers=2)
    model = load_model(path, device=dev)
    runner = ModelRunner(model, num_pages=24, page_size=4, dtype=torch.float32, device=dev,
                         attention_backend="triton")
    alloc = runner.pool.allocator
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (5, 9, 2)]
    tables = [alloc.alloc(3) for _ in prompts]
    runner.forward([(p, 0, t) for p, t in zip(prompts, tables)])
    seqs = [([p[-1]], len(p), t) for p, t in zip(prompts, tables)]
    kv_before = runner.pool.kv.clone()
    eager = runner.forward(seqs)
    kv_eager = runner.pool.kv.clone()
    runner.pool.kv.copy_(kv_before)
    inp = DecodeGraphInputs(max_bs=4, max_pages=8, page_size=4, device=dev)
    batch = ForwardBatch.build(runner.pool, seqs)
    inp.fill(batch, 4)
    padded = model(inp.batch(4), runner.attn)
    assert padded.shape[0] == 4
    torch.testing.assert_close(padded[:3], eager, atol=1e-5, rtol=1e-5)
    # The real rows' slots got their K/V (to float rounding: GEMMs of 4 rows vs 3), every other
    # slot is untouched (the padding row wrote nowhere).
    slots = batch.out_slots
    torch.testing.assert_close(runner.pool.kv[:, :, slots], kv_eager[:, :, slots])
    runner.pool.kv[:, :, slots] = kv_before[:, :, slots]
    assert torch.equal(runner.pool.kv, kv_before)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_capture_and_replay_equal_eager(checkpoint_factory: Callable[..., Path]) -> None:
    pytest.importorskip("triton", reason="needs the triton package")
    from engine.model_runner import ModelRunner
    from engine.models import load_model

    dev = torch.device("cuda")
    path = checkpoint_factory("llama", with_tokenizer=False, layers=2)
    runners = [
        ModelRunner(load_model(path, device=dev), num_pages=64, page_size=4,
                    dtype=torch.float32, device=dev, attention_backend="triton",
                    cuda_graph_max_bs=bs, context_length=128)
        for bs in (0, 8)
    ]
    assert runners[0].graph_runner is None
    assert runners[1].graph_runner is not None, runners[1].cuda_graph_error
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (5, 30, 11)]
    outs = []
    for r in runners:
        # Different page placement in each runner: the page table is a graph input.
        tables = [r.pool.allocator.alloc(12) for _ in prompts]
        if r.graph_runner is not None:
            tables = tables[::-1]
        logits = r.forward([(p, 0, t) for p, t in zip(prompts, tables)])
        toks = logits.argmax(-1).tolist()
        steps = []
        # 3 requests (replayed padded to 4), then 2 (the third finished), then 1.
        for s, n in enumerate((3, 3, 2, 2, 1)):
            seqs = [([toks[i]], len(prompts[i]) + s, tables[i]) for i in range(n)]
            out = r.forward(seqs)
            steps.append(out.clone())
            toks = out.argmax(-1).tolist()
        outs.append(steps)
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    gr = runners[1].graph_runner
    assert sorted(gr.graphs) == [1, 2, 4, 8]
    assert gr.replays == 5
