"""Tensor-parallel models: two real rank processes (gloo, spawn) against the one-rank model.

Each rank loads only its shard, runs prefill, a chunk over the cached prefix and decode through
`ModelRunner` + its paged pool; its logits must equal the TP=1 logits (tolerance) and be
bit-identical across ranks, and its pool must hold exactly its KV heads of the TP=1 pool (the
same latent on both ranks for MLA).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from engine.distributed import TPGroup
from engine.model_runner import ModelRunner
from engine.models import load_model
from hicache_client.errors import ConfigError
from tests.engine.test_mla_models import MLA_CASES, runner_logits
from tests.procs import free_port

VOCAB = 1001  # odd: the last rank's vocabulary shard is padded
LLAMA_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # 4 query heads, 1 KV head: both ranks keep (a copy of) KV head 0.
    "llama_gqa_kv1": ("llama", {"kv_heads": 1, "attention_bias": True,
                                "tie_word_embeddings": True, "vocab_size": VOCAB}),
    "qwen2_bias": ("qwen2", {"kv_heads": 2, "vocab_size": VOCAB}),
    "qwen3_qk_norm": ("qwen3", {"kv_heads": 2, "head_dim": 32}),
    "llama_mlp_bias": ("llama", {"kv_heads": 4, "mlp_bias": True}),
}
TP_MLA = ("v2_greedy_bias", "v3_yarn")


def _checkpoints(factory: Callable[..., Path]) -> dict[str, Path]:
    out = {name: factory(kind, with_tokenizer=False, **kw)
           for name, (kind, kw) in LLAMA_CASES.items()}
    for name in TP_MLA:
        kind, kw = MLA_CASES[name]
        out[name] = factory(kind, with_tokenizer=False, **kw)
    return out


def _ids(n: int = 40) -> list[int]:
    return torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(7)).tolist()


def _run(model: Any) -> dict[str, torch.Tensor]:
    runner = ModelRunner(model, num_pages=16, page_size=4, dtype=torch.float32,
                         device=torch.device("cpu"), attention_backend="torch")
    pages = [9, 3, 12, 0, 5, 7, 1, 14, 2, 11]
    logits = runner_logits(runner, _ids(), pages)
    return {"logits": logits, "kv": runner.pool.kv[:, :, runner.pool.slots(pages, 40)].clone()}


def rank_main(rank: int, port: int, paths: dict[str, str], out: str) -> None:
    """One rank of the group: each case's logits and pool rows into `out/{case}-{rank}.pt`."""
    from engine.distributed import destroy_tp_group, init_tp_group

    torch.set_num_threads(1)
    tp = init_tp_group(rank, 2, init_method=f"tcp://127.0.0.1:{port}",
                       device=torch.device("cpu"), timeout_s=120)
    try:
        for name, path in paths.items():
            torch.save(_run(load_model(path, tp=tp)), Path(out) / f"{name}-{rank}.pt")
        # Neither rank closes its gloo pairs while the other may still be reading from them.
        torch.distributed.barrier(group=tp.cpu_group)
    except BaseException:
        (Path(out) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        destroy_tp_group(tp)
    # Gloo's worker threads can abort the interpreter's finalization (SIGABRT, "terminate
    # called without an active exception", seen once in CI); this rank's work is done and saved.
    os._exit(0)


def test_two_ranks_equal_one(checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    paths = _checkpoints(checkpoint_factory)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, port, {k: str(v) for k, v in paths.items()},
                                                 str(tmp_path)))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
        err = tmp_path / f"error-{r}.txt"
        assert p.exitcode == 0, err.read_text() if err.exists() else f"rank {r}: {p.exitcode}"
    torch.set_num_threads(1)
    for name, path in paths.items():
        solo = _run(load_model(path))
        ranks = [torch.load(tmp_path / f"{name}-{r}.pt") for r in range(2)]
        for got in ranks:
            assert got["logits"].shape == solo["logits"].shape == (40, solo["logits"].shape[1])
            torch.testing.assert_close(got["logits"], solo["logits"], atol=1e-4, rtol=1e-4)
            assert torch.equal(got["logits"].argmax(-1), solo["logits"].argmax(-1))
        assert torch.equal(ranks[0]["logits"], ranks[1]["logits"]), name
        kv0, kv1, kv = ranks[0]["kv"], ranks[1]["kv"], solo["kv"]
        if name in TP_MLA:  # one latent, identical on both ranks and equal to TP=1's
            assert kv0.shape == kv.shape and kv.shape[0] == 1
            assert torch.equal(kv0, kv1)
            torch.testing.assert_close(kv0, kv, atol=1e-5, rtol=1e-5)
            continue
        heads = kv.shape[3]
        if heads == 1:  # fewer KV heads than ranks: both keep the one head
            want = [kv, kv]
        else:
            want = [kv[:, :, :, : heads // 2], kv[:, :, :, heads // 2 :]]
        for got, w in zip((kv0, kv1), want):
            assert got.shape == w.shape
            torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-5)


def _tensor(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name)


def test_rank_loads_its_slices(checkpoint_factory: Callable[..., Path]) -> None:
    """Rank 1 of 2 holds exactly its rows/columns of each checkpoint tensor (no collective runs
    while loading, so one process can load any rank's shard)."""
    path = checkpoint_factory("qwen2", with_tokenizer=False, kv_heads=2, vocab_size=VOCAB)
    m = load_model(path, tp=TPGroup(rank=1, size=2))
    p = dict(m.named_parameters())
    a = "model.layers.1.self_attn."
    assert torch.equal(p[a + "q_proj.weight"], _tensor(path, a + "q_proj.weight")[32:])
    assert torch.equal(p[a + "q_proj.bias"], _tensor(path, a + "q_proj.bias")[32:])
    assert torch.equal(p[a + "k_proj.weight"], _tensor(path, a + "k_proj.weight")[16:])
    assert torch.equal(p[a + "o_proj.weight"], _tensor(path, a + "o_proj.weight")[:, 32:])
    f = "model.layers.0.mlp."
    assert torch.equal(p[f + "up_proj.weight"], _tensor(path, f + "up_proj.weight")[64:])
    assert torch.equal(p[f + "down_proj.weight"], _tensor(path, f + "down_proj.weight")[:, 64:])
    emb = _tensor(path, "model.embed_tokens.weight")
    assert p["model.embed_tokens.weight"].shape == (501, 64)
    assert torch.equal(p["model.embed_tokens.weight"][:500], emb[501:])
    assert not p["model.embed_tokens.weight"][500].any()  # padding row
    assert m.kv_spec.num_heads == 2 and m.kv_spec.kv_heads == 1

    kind, kw = MLA_CASES["v3_yarn"]
    dpath = checkpoint_factory(kind, with_tokenizer=False, **kw)
    d = dict(load_model(dpath, tp=TPGroup(rank=1, size=2)).named_parameters())
    a = "model.layers.2.self_attn."
    assert torch.equal(d[a + "kv_b_proj.weight"], _tensor(dpath, a + "kv_b_proj.weight")[64:])
    assert torch.equal(d[a + "q_b_proj.weight"], _tensor(dpath, a + "q_b_proj.weight")[48:])
    assert torch.equal(d[a + "kv_a_proj_with_mqa.weight"],
                       _tensor(dpath, a + "kv_a_proj_with_mqa.weight"))  # replicated
    e = "model.layers.2.mlp.experts."
    gate_up = d[e + "gate_up_proj"]
    assert gate_up.shape == (8, 32, 64)
    assert torch.equal(gate_up[5, :16], _tensor(dpath, e + "5.gate_proj.weight")[16:])
    assert torch.equal(gate_up[5, 16:], _tensor(dpath, e + "5.up_proj.weight")[16:])
    assert torch.equal(d[e + "down_proj"][3], _tensor(dpath, e + "3.down_proj.weight")[:, 16:])
    assert d["model.layers.2.mlp.gate.weight"].dtype == torch.float32


def test_heads_that_do_not_divide(checkpoint_factory: Callable[..., Path]) -> None:
    path = checkpoint_factory("qwen2", with_tokenizer=False, kv_heads=2, vocab_size=VOCAB)
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) is not divisible by "
                                          r"tp_size 3"):
        load_model(path, tp=TPGroup(rank=0, size=3))
    odd = checkpoint_factory("llama", with_tokenizer=False, heads=6, kv_heads=3,
                             hidden_size=96)
    with pytest.raises(ConfigError, match=r"num_key_value_heads \(3\) is not divisible by "
                                          r"tp_size 2"):
        load_model(odd, tp=TPGroup(rank=0, size=2))
    with pytest.raises(ConfigError, match=r"tp_size 4 is not a multiple of num_key_value_heads "
                                          r"\(3\)"):
        load_model(checkpoint_factory("llama", with_tokenizer=False, heads=12, kv_heads=3,
                                      hidden_size=96), tp=TPGroup(rank=0, size=4))
    # 4 query heads, 2 KV heads, 4 ranks: ranks 0-1 keep KV head 0, ranks 2-3 KV head 1.
    wide = checkpoint_factory("qwen2", with_tokenizer=False, kv_heads=2, vocab_size=VOCAB)
    k = _tensor(wide, "model.layers.0.self_attn.k_proj.weight")
    for rank, head in ((0, 0), (1, 0), (2, 1), (3, 1)):
        m = load_model(wide, tp=TPGroup(rank=rank, size=4))
        got = dict(m.named_parameters())["model.layers.0.self_attn.k_proj.weight"]
        assert torch.equal(got, k[head * 16 : (head + 1) * 16])
        assert m.kv_spec.kv_heads == 1 and m.kv_spec.num_heads == 1
    kind, kw = MLA_CASES["v3_yarn"]
    mla = checkpoint_factory(kind, with_tokenizer=False, **kw)
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) is not divisible"):
        load_model(mla, tp=TPGroup(rank=0, size=3))


def test_checkpoint_wider_than_its_config_is_an_error(
    checkpoint_factory: Callable[..., Path], tmp_path: Path
) -> None:
    """A rank reads a slice of each tensor, so a tensor with more heads than the config says
    must fail loudly rather than give the rank some of the wrong rows."""
    import json
    import shutil

    src = checkpoint_factory("qwen2", with_tokenizer=False, kv_heads=2, vocab_size=VOCAB)
    shutil.copytree(src, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["num_key_value_heads"] = 1  # k_proj / v_proj really hold 2 heads of 16
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    for tp in (TPGroup.solo(), TPGroup(rank=1, size=2)):
        with pytest.raises(ConfigError, match=r"k_proj.(weight|bias)' has shape \(32(, 64)?,?\); "
                                              r"the config implies 16 along dimension 0"):
            load_model(tmp_path / "m", tp=tp)
