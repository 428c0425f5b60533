"""Factories for the engine tests: tiny random-weight checkpoints (transformers writes them)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.demo_model import ensure_demo_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def randomize(model: torch.nn.Module, seed: int, scale: float = 1.0) -> None:
    """Every parameter random (biases and norm weights too), so each term is exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                std = fan_in**-0.5 * (scale if name.startswith("lm_head") else 1.0)
                p.copy_(std * torch.randn(p.shape, generator=g))


def make_checkpoint(
    out: Path,
    kind: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int = 1024,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    with_tokenizer: bool = True,
    max_shard_size: str | None = None,
    lm_head_scale: float = 8.0,
    **extra: Any,
) -> Path:
    """A random-weight checkpoint of `kind` (llama, qwen2, qwen3, mistral, deepseek_v2,
    deepseek_v3: MLA fields in `extra`) saved by transformers (safetensors), with the demo
    model's tokenizer when `with_tokenizer`."""
    from transformers import (
        AutoModelForCausalLM,
        DeepseekV2Config,
        DeepseekV3Config,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
           "mistral": MistralConfig, "deepseek_v2": DeepseekV2Config,
           "deepseek_v3": DeepseekV3Config}[kind]
    cfg = cls(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=2048, eos_token_id=None, bos_token_id=None, **extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    randomize(model, seed, lm_head_scale)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kw)
    if with_tokenizer:
        demo = ensure_demo_model()
        for f in TOKENIZER_FILES:
            shutil.copy(demo / f, out / f)
    return out


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    made: dict[tuple[Any, ...], Path] = {}

    def factory(kind: str = "llama", **kw: Any) -> Path:
        key = (kind, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in made:
            made[key] = make_checkpoint(tmp_path_factory.mktemp(f"ckpt-{kind}"), kind, **kw)
        return made[key]

    return factory


@pytest.fixture(scope="session")
def tiny_model(checkpoint_factory: Callable[..., Path]) -> Path:
    """The checkpoint most engine tests run: Llama, 2 layers, hidden 64, vocab 1024."""
    return checkpoint_factory("llama")


@pytest.fixture(autouse=True, scope="session")
def _demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Build the demo model in a temp dir, never in the user's ~/.cache."""
    import os

    if "HICACHE_DEMO_MODEL_DIR" not in os.environ:
        os.environ["HICACHE_DEMO_MODEL_DIR"] = str(tmp_path_factory.mktemp("demo") / "model")


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread() -> Any:
    """Tiny models run fastest on one thread, above all on a shared, loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
