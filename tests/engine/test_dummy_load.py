"""`--load-format dummy`: a model from config.json alone with seeded random weights made on the
device; the shipped configs of Llama-3.1-8B, Qwen2.5-7B and DeepSeek-V2-Lite at their real
shapes (built on `meta`, nothing allocated); an engine without a tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.demo_model import resolve_model_path as resolve_model
from engine.engine import Engine
from engine.models.config import ModelConfig, kv_bytes_per_token
from engine.models.dummy import INIT_STD, shipped_configs
from engine.models.loader import build_model, load_model
from hicache_client.errors import ConfigError

TINY_LLAMA: dict[str, Any] = {
    "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 512, "max_position_embeddings": 1024, "eos_token_id": 7,
}
TINY_MLA: dict[str, Any] = {
    "model_type": "deepseek_v2", "hidden_size": 64, "intermediate_size": 128,
    "moe_intermediate_size": 32, "num_hidden_layers": 2, "first_k_dense_replace": 1,
    "num_attention_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "vocab_size": 512,
    "max_position_embeddings": 1024,
}
PARAMS = {"max_new_tokens": 8, "ignore_eos": True}
PROMPTS = [[(11 * i + 5 * j) % 500 + 1 for j in range(37)] for i in range(2)]

# Published sizes: parameters, and KV bytes per token in bf16 (K and V of every KV head per
# layer; one 512 + 64 latent per layer for DeepSeek's MLA).
SHIPPED = {
    "llama-3.1-8b": (8_030_261_248, 32 * 8 * 128 * 2 * 2),  # 128 KiB per token
    "qwen2.5-7b": (7_615_616_512, 28 * 4 * 128 * 2 * 2),
    "deepseek-v2-lite": (15_706_484_224, 27 * (512 + 64) * 2),
}


def config_dir(tmp_path: Path, cfg: dict[str, Any], name: str = "cfg") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("cfg", [TINY_LLAMA, TINY_MLA], ids=["llama", "mla"])
def test_dummy_weights_are_seeded_and_shaped_like_an_init(tmp_path: Path, cfg: dict) -> None:
    d = config_dir(tmp_path, cfg)
    a = dict(load_model(d, load_format="dummy", seed=3).named_parameters())
    b = dict(load_model(d, load_format="dummy", seed=3).named_parameters())
    c = dict(load_model(d, load_format="dummy", seed=4).named_parameters())
    assert a.keys() == b.keys() == c.keys()
    for name, p in a.items():
        assert torch.equal(p, b[name]), name
        if name.endswith("bias"):
            assert not p.any(), name
        elif p.dim() == 1 and name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert not torch.equal(p, c[name]), name  # another seed, other weights
            if p.numel() >= 4096:
                assert abs(float(p.float().std()) - INIT_STD) < 0.1 * INIT_STD, name


def test_dummy_needs_no_checkpoint_and_auto_says_so(tmp_path: Path) -> None:
    d = config_dir(tmp_path, TINY_LLAMA)
    with pytest.raises(ConfigError, match="--load-format dummy"):
        load_model(d)
    with pytest.raises(ConfigError, match="unknown load_format"):
        load_model(d, load_format="safetensors")


@pytest.mark.parametrize("cfg", [TINY_LLAMA, TINY_MLA], ids=["llama", "mla"])
def test_engine_on_a_config_alone_is_deterministic(tmp_path: Path, cfg: dict) -> None:
    d = config_dir(tmp_path, cfg)
    kw: dict[str, Any] = {"model_path": str(d), "load_format": "dummy", "page_size": 4,
                          "max_total_tokens": 512}

    def run(seed: int) -> tuple[list[list[int]], str]:
        with Engine(**kw, random_seed=seed) as eng:
            logits = eng.runner.forward([(PROMPTS[0], 0, eng.runner.pool.allocator.alloc(10))])
            assert torch.isfinite(logits).all()
            out = eng.generate(input_ids=PROMPTS, sampling_params=PARAMS)
            assert [r["text"] for r in out] == ["", ""]  # no tokenizer: ids only
            with pytest.raises(ValueError, match="no tokenizer.*input_ids"):
                eng.generate("a text prompt", sampling_params=PARAMS)
            with pytest.raises(ValueError, match="no tokenizer.*input_ids"):
                eng.encode_chat([{"role": "user", "content": "hi"}])
            return [r["output_ids"] for r in out], eng.model_id

    first, id1 = run(1)
    again, id2 = run(1)
    other, id3 = run(2)
    assert first == again and id1 == id2
    assert all(len(o) == PARAMS["max_new_tokens"] for o in first)
    assert first != other and id3 != id1  # the seed names the weights, so the KV


def test_dummy_engine_with_a_tokenizer_takes_text(tmp_path: Path) -> None:
    from engine.demo_model import ensure_demo_model

    demo = ensure_demo_model()
    d = config_dir(tmp_path, json.loads((demo / "config.json").read_text()))
    with Engine(model_path=str(d), tokenizer_path=str(demo), load_format="dummy",
                page_size=4, max_total_tokens=256) as eng:
        out = eng.generate("Hello there", sampling_params={"max_new_tokens": 3,
                                                           "ignore_eos": True})[0]
        assert len(out["output_ids"]) == 3 and isinstance(out["text"], str)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_configs_at_real_shape_on_meta(name: str) -> None:
    assert sorted(SHIPPED) == shipped_configs()
    path = resolve_model(name)
    assert path.name == name and (path / "config.json").is_file()
    assert sorted(p.name for p in path.iterdir()) == ["config.json"]  # no weights shipped
    cfg = ModelConfig.from_dir(path)
    params, kv = SHIPPED[name]
    assert kv_bytes_per_token(cfg, 2) == kv
    model = build_model(cfg, dtype=torch.bfloat16, device="meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert sum(p.numel() for p in model.parameters()) == params
    model = load_model(path, dtype=torch.bfloat16, device="meta", load_format="dummy")
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_shipped_config_llama_shape() -> None:
    cfg = ModelConfig.from_dir(resolve_model("llama-3.1-8b"))
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size, cfg.rope_theta, cfg.rope_type) == (
        4096, 32, 32, 8, 128, 128256, 500000.0, "llama3")
    assert kv_bytes_per_token(cfg, 2) == 128 * 1024
