"""DeepSeek-V2/V3 (MLA + MoE) through `ModelRunner` and the paged latent pool, against the
transformers implementation of the same random-weight checkpoint (fp32, tolerance 1e-4 as the
Llama tests)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.model_runner import ModelRunner
from engine.models import ModelConfig, load_model
from engine.models.config import kv_bytes_per_token
from hicache_client.errors import ConfigError

# Small DeepSeek shapes: 3 layers (one dense, two MoE), 4 heads, latent 32 + 8.
MLA_BASE: dict[str, Any] = {
    "intermediate_size": 96, "moe_intermediate_size": 32, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "layers": 3, "heads": 4,
    "kv_heads": 4,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
        "mscale": 0.9, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1,
        "rope_theta": 10000.0}
# V2: q_proj (no q LoRA), softmax gating; V3: q LoRA, sigmoid noaux_tc, YaRN.
MLA_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "v2_greedy_bias": ("deepseek_v2", {
        **MLA_BASE, "q_lora_rank": None, "topk_method": "greedy", "n_shared_experts": 2,
        "attention_bias": True, "mlp_bias": True, "routed_scaling_factor": 1.5}),
    "v2_group_limited": ("deepseek_v2", {
        **MLA_BASE, "q_lora_rank": None, "topk_method": "group_limited_greedy", "n_group": 4,
        "topk_group": 2, "n_shared_experts": 1}),
    "v3_yarn": ("deepseek_v3", {
        **MLA_BASE, "q_lora_rank": 24, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rope_parameters": YARN}),
    "v3_no_interleave": ("deepseek_v3", {
        **MLA_BASE, "q_lora_rank": 24, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
        "norm_topk_prob": False, "rope_interleave": False, "first_k_dense_replace": 0}),
}


def mla_checkpoint(factory: Callable[..., Path], case: str, **kw: Any) -> Path:
    kind, extra = MLA_CASES[case]
    return factory(kind, with_tokenizer=False, **{**extra, **kw})


def reference_logits(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def runner_logits(runner: ModelRunner, ids: list[int], pages: list[int]) -> torch.Tensor:
    """Prefill 13 tokens (all logits), a 14-token chunk over that cached prefix, then decode one
    token at a time."""
    rows = [runner.forward([(ids[:13], 0, pages)], last_only=False)]
    rows.append(runner.forward([(ids[13:27], 13, pages)], last_only=False))
    for i in range(27, len(ids)):
        rows.append(runner.forward([(ids[i : i + 1], i, pages)]))
    return torch.cat(rows)


@pytest.mark.parametrize("case", list(MLA_CASES))
def test_mla_logits_match_transformers(checkpoint_factory: Callable[..., Path], case: str) -> None:
    path = mla_checkpoint(checkpoint_factory, case)
    ids = torch.randint(0, 1024, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = reference_logits(path, ids)
    model = load_model(path)
    runner = ModelRunner(model, num_pages=32, page_size=4, dtype=torch.float32,
                         device=torch.device("cpu"), attention_backend="torch")
    cfg = model.config
    # The pool holds one latent per token and layer: [kv_c | k_pe], 32 + 8 wide.
    assert runner.pool.mla and runner.pool.kv.shape == (1, 3, 128, 1, 40)
    assert runner.pool.bytes_per_token == kv_bytes_per_token(cfg, 4) == 3 * 40 * 4
    pages = runner.pool.allocator.alloc(10)
    assert pages is not None
    ours = runner_logits(runner, ids, pages)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    # Greedy next tokens agree everywhere (the logits are not flat).
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_mla_batched_requests_match_solo(checkpoint_factory: Callable[..., Path]) -> None:
    """Requests of different lengths prefilled together and decoded in one batch (MoE routing
    over a mixed batch) give their solo logits."""
    path = mla_checkpoint(checkpoint_factory, "v3_yarn")
    runner = ModelRunner(load_model(path), num_pages=64, page_size=4, dtype=torch.float32,
                         device=torch.device("cpu"), attention_backend="torch")
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (5, 17, 9)]
    tables = [runner.pool.allocator.alloc(6) for _ in seqs]
    solo = torch.stack([reference_logits(path, s)[-1] for s in seqs])
    runner.forward([(s[:-1], 0, t) for s, t in zip(seqs, tables)])
    out = runner.forward([(s[-1:], len(s) - 1, t) for s, t in zip(seqs, tables)])
    torch.testing.assert_close(out, solo, atol=1e-4, rtol=1e-4)


def test_the_latent_is_what_the_pool_holds(checkpoint_factory: Callable[..., Path]) -> None:
    """The pool's row of a token is transformers' normalised kv_c and rotated k_pe of that
    token (the only KV there is), so pages moved to host and L3 carry the model's cache."""
    from transformers import AutoModelForCausalLM

    path = mla_checkpoint(checkpoint_factory, "v3_yarn")
    ids = list(range(3, 23))
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = ref(torch.tensor([ids]), use_cache=True)
    runner = ModelRunner(load_model(path), num_pages=8, page_size=4, dtype=torch.float32,
                         device=torch.device("cpu"), attention_backend="torch")
    pages = [5, 2, 7, 0, 3]
    runner.forward([(ids, 0, pages)])
    slots = runner.pool.slots(pages, len(ids))
    layer = out.past_key_values.layers[1]
    kv_c, k_pe = layer.keys[0, 0], layer.values[0, 0]  # [T, kv_lora], [T, rope]
    ours = runner.pool.kv[0, 1, slots, 0]
    assert ours.shape == (20, 40)
    # Both keep V3's rotated pairs as [evens | odds].
    torch.testing.assert_close(ours, torch.cat([kv_c, k_pe], -1), atol=1e-5, rtol=1e-5)


def test_mla_config_fields_and_errors() -> None:
    base = {"model_type": "deepseek_v3", "vocab_size": 8, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
            "kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 2,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
            "first_k_dense_replace": 1, "q_lora_rank": None}
    c = ModelConfig.from_dict(base)
    assert c.is_mla and c.topk_method == "noaux_tc" and c.norm_topk_prob
    assert (c.num_kv_heads, c.head_dim, c.routed_scaling_factor) == (1, 2, 2.5)
    spec = c.kv_spec(2)
    assert (spec.kv_heads, spec.head_dim, spec.v_head_dim, spec.num_heads, spec.mla) == (
        1, 6, 4, 1, True)
    assert spec.scale == pytest.approx(4**-0.5)
    assert kv_bytes_per_token(c, 2, tp_size=2) == kv_bytes_per_token(c, 2) == 2 * 6 * 2
    llama = ModelConfig.from_dict({k: base[k] for k in ("vocab_size", "hidden_size",
                                                        "intermediate_size",
                                                        "num_hidden_layers")}
                                  | {"num_attention_heads": 4, "num_key_value_heads": 2})
    assert not llama.is_mla and kv_bytes_per_token(llama, 2) == 2 * 2 * 2 * 2 * 2
    assert kv_bytes_per_token(llama, 2, tp_size=2) == 2 * 2 * 1 * 2 * 2
    assert kv_bytes_per_token(llama, 2, tp_size=4) == 2 * 2 * 1 * 2 * 2  # replicated KV head
    yarn = ModelConfig.from_dict({**base, "rope_scaling": {"type": "yarn", "factor": 40,
                                                           "mscale_all_dim": 1.0,
                                                           "original_max_position_embeddings":
                                                               4096}})
    m = 0.1 * 1.0 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert yarn.kv_spec().scale == pytest.approx(4**-0.5 * m * m)
    with pytest.raises(ConfigError, match="unsupported rope type 'llama3' for deepseek_v3"):
        ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "llama3"}})
    with pytest.raises(ConfigError, match="unsupported topk_method 'noaux_tc' for deepseek_v2"):
        ModelConfig.from_dict({**base, "model_type": "deepseek_v2", "topk_method": "noaux_tc"})
    with pytest.raises(ConfigError, match="do not make expert groups"):
        ModelConfig.from_dict({**base, "n_group": 3})
    with pytest.raises(ConfigError, match="quantized deepseek_v3 checkpoints are not supported"):
        ModelConfig.from_dict({**base, "quantization_config": {"quant_method": "fp8"}})


def test_mla_checkpoint_errors(checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    """A missing expert or a fused expert tensor is a clear error, not a silently zero expert."""
    from safetensors.torch import load_file, save_file

    src = mla_checkpoint(checkpoint_factory, "v2_group_limited")
    tensors = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    dropped = {k: v for k, v in tensors.items()
               if k != "model.layers.2.mlp.experts.5.up_proj.weight"}
    save_file(dropped, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="lacks 1 tensors.*layers.2.mlp.experts.gate_up_proj"):
        load_model(tmp_path)
    fused = dict(dropped, **{"model.layers.2.mlp.experts.gate_up_proj": torch.zeros(8, 64, 64)})
    save_file(fused, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="not in the per-expert layout"):
        load_model(tmp_path)
