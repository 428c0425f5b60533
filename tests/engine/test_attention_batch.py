"""`ForwardBatch` step metadata, the ragged batched forward of the runner and the `wait_layer`
hook (torch backend, CPU)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.attention import ForwardBatch
from engine.model_runner import ModelRunner
from engine.models import load_model
from hicache.pools import DeviceKVPool


def test_build_metadata_exact() -> None:
    pool = DeviceKVPool(num_pages=16, page_size=4, num_layers=1, kv_heads=1, head_dim=4)
    # A 3-token chunk after a 5-token prefix, a decode token at position 2, a 2-token prompt.
    seqs = [([7, 8, 9], 5, [3, 11, 6]), ([4], 2, [9]), ([1, 2], 0, [14, 15])]
    b = ForwardBatch.build(pool, seqs)
    assert b.input_ids.tolist() == [7, 8, 9, 4, 1, 2]
    assert b.positions.tolist() == [5, 6, 7, 2, 0, 1]
    assert b.out_slots.tolist() == [11 * 4 + 1, 11 * 4 + 2, 11 * 4 + 3, 9 * 4 + 2, 56, 57]
    assert b.page_table.dtype == torch.int32
    assert b.page_table.tolist() == [[3, 11], [9, 0], [14, 0]]  # pages past kv_len dropped
    assert b.q_lens_t.tolist() == b.q_lens == [3, 1, 2]
    assert b.kv_lens_t.tolist() == b.kv_lens == [8, 3, 2]
    assert b.q_starts.tolist() == [0, 3, 4, 6]
    assert b.logits_rows is not None and b.logits_rows.tolist() == [2, 3, 5]
    assert not b.is_decode and b.max_q_len == 3
    assert ForwardBatch.build(pool, seqs, last_only=False).logits_rows is None
    d = ForwardBatch.build(pool, [([5], 3, [2]), ([6], 4, [7, 1])])
    assert d.is_decode and d.logits_rows is None  # one row per request already
    assert d.positions.tolist() == [3, 4] and d.out_slots.tolist() == [11, 4]
    assert d.kv_slots().tolist() == [[8, 9, 10, 11, 0, 1, 2, 3], [28, 29, 30, 31, 4, 5, 6, 7]]


def test_build_rejects_short_page_table() -> None:
    pool = DeviceKVPool(num_pages=4, page_size=4, num_layers=1, kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="covers 4 slots, need 6"):
        ForwardBatch.build(pool, [([1, 2], 4, [0])])
    with pytest.raises(ValueError, match="at least one request"):
        ForwardBatch.build(pool, [])


@pytest.fixture(scope="module")
def runner(checkpoint_factory: Callable[..., Path]) -> ModelRunner:
    path = checkpoint_factory("llama", with_tokenizer=False, layers=3)
    return ModelRunner(load_model(path), num_pages=64, page_size=4, dtype=torch.float32,
                       device=torch.device("cpu"), attention_backend="torch")


def test_ragged_prefill_equals_one_request_at_a_time(runner: ModelRunner) -> None:
    """Several requests' extend chunks (over cached prefixes and not) in one forward give the
    logits each gets alone: the runner API the scheduler fills its prefill budget with."""
    alloc = runner.pool.allocator
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (13, 6, 22)]
    cached = [8, 0, 5]  # prefix tokens computed by an earlier step
    solo, batched = [], []
    for rows in (solo, batched):
        tables = [alloc.alloc(6) for _ in prompts]
        for p, c, t in zip(prompts, cached, tables):
            if c:
                runner.forward([(p[:c], 0, t)])
        chunks = [(p[c:], c, t) for p, c, t in zip(prompts, cached, tables)]
        if rows is solo:
            rows.extend(runner.forward([s], last_only=False) for s in chunks)
        else:
            out = runner.forward(chunks, last_only=False)
            starts = [0, 5, 11, 28]
            rows.extend(out[a:b] for a, b in zip(starts, starts[1:]))
        for t in tables:
            alloc.free(t)
    for a, b in zip(solo, batched):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_wait_layer_called_once_per_layer_in_order(runner: ModelRunner) -> None:
    calls: list[int] = []
    pages = runner.pool.allocator.alloc(4)
    assert pages is not None
    ids = list(range(1, 11))
    plain = runner.forward([(ids, 0, pages)])
    # The hook runs before the layer reads the pool: K/V of layer i is not yet written then.
    written: list[bool] = []
    slot = pages[0] * 4

    def wait(i: int) -> None:
        calls.append(i)
        written.append(bool(runner.pool.k_buffer[i][slot].abs().sum() > 0))

    runner.pool.kv.zero_()
    hooked = runner.forward([(ids, 0, pages)], wait_layer=wait)
    assert calls == [0, 1, 2]
    assert written == [False, False, False]
    torch.testing.assert_close(hooked, plain, atol=0, rtol=0)
    calls.clear()
    runner.forward([([5], 10, pages)], wait_layer=wait)  # decode steps too
    assert calls == [0, 1, 2]
    runner.pool.allocator.free(pages)
