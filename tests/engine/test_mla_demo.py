"""The MLA demo checkpoint (`ensure_demo_model(variant="mla")`): deterministic, loadable by
transformers' DeepseekV3ForCausalLM with equal logits, and served end to end by the engine with
its latent pages going through host memory and an L3 store (greedy outputs equal to caching
off)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.demo_model import (
    DEMO_MLA_ARCH,
    checkpoint_digest,
    default_dir,
    ensure_demo_model,
    write_demo_model,
)
from engine.model_runner import ModelRunner
from engine.models import load_model


@pytest.fixture(scope="module")
def mla_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("mla-demo") / "model", variant="mla")


def test_mla_demo_is_deterministic_and_separate(tmp_path: Path, mla_demo: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    again = write_demo_model(tmp_path / "b", "mla")
    assert checkpoint_digest(again) == checkpoint_digest(mla_demo)
    cfg = json.loads((mla_demo / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3"
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["first_k_dense_replace"]) == (
        128, 16, 2)
    llama = json.loads((ensure_demo_model() / "config.json").read_text())
    assert llama["model_type"] == "llama"  # the default demo is unchanged
    assert (mla_demo / "tokenizer.json").read_bytes() == (
        ensure_demo_model() / "tokenizer.json").read_bytes()
    monkeypatch.setenv("HICACHE_DEMO_MLA_MODEL_DIR", str(tmp_path / "env"))
    assert default_dir("mla") == tmp_path / "env"
    assert default_dir("llama") != default_dir("mla")
    monkeypatch.delenv("HICACHE_DEMO_MLA_MODEL_DIR")
    assert default_dir("mla").name == "demo-mla-model-v1"
    with pytest.raises(ValueError, match="unknown demo model variant 'gpt'"):
        ensure_demo_model(tmp_path / "x", variant="gpt")


def test_transformers_loads_the_mla_demo(mla_demo: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3ForCausalLM

    tok = AutoTokenizer.from_pretrained(mla_demo)
    ids = tok("The cache keeps a copy of something expensive.")["input_ids"]
    ref = AutoModelForCausalLM.from_pretrained(mla_demo, dtype=torch.float32).eval()
    assert isinstance(ref, DeepseekV3ForCausalLM)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    model = load_model(mla_demo)
    runner = ModelRunner(model, num_pages=4, page_size=16, dtype=torch.float32,
                         device=torch.device("cpu"), attention_backend="torch")
    assert runner.pool.kv.shape == (1, 4, 64, 1, 144)  # one 128 + 16 latent per token, layer
    got = runner.forward([(ids, 0, [2, 0])], last_only=False)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert DEMO_MLA_ARCH["n_routed_experts"] == 8


def test_engine_serves_mla_latents_from_every_tier(mla_demo: Path, tmp_path: Path) -> None:
    """Latent pages written through host memory to a file store; a fresh engine reads them back
    from L3: greedy outputs equal to caching off."""
    from engine.engine import Engine

    store = tmp_path / "pages"
    args = {"model_path": str(mla_demo), "page_size": 4, "max_total_tokens": 512,
            "enable_hierarchical_cache": True, "hicache_storage_backend": "file",
            "hicache_storage_prefetch_policy": "wait_complete",
            "hicache_storage_backend_extra_config": {"path": str(store),
                                                     "prefetch_threshold": 8}}
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(5, 1000, (41,), generator=g).tolist()
    params = {"max_new_tokens": 6, "ignore_eos": True}
    with Engine(model_path=str(mla_demo), disable_radix_cache=True, page_size=4) as off:
        assert off.runner.pool.mla
        expected = off.generate(input_ids=prompt, sampling_params=params)[0]["output_ids"]
    with Engine(**args) as first:
        assert first.runner.pool.mla and first.cache.host_pool.mla
        assert first.generate(input_ids=prompt, sampling_params=params)[0][
            "output_ids"] == expected
        first.wait_transfers(timeout=60)
        assert first.cache_stats()["storage_backup_pages"] >= 10
    with Engine(**args) as second:
        got = second.generate(input_ids=prompt, sampling_params=params)[0]
        stats = second.cache_stats()
    assert got["output_ids"] == expected
    assert stats["storage_hit_tokens"] == got["meta_info"]["cached_tokens"] == 40
