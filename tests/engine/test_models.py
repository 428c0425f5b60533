"""Our decoder against the transformers implementation of the same random-weight checkpoint."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from engine.attention import ForwardBatch, make_attention_backend
from engine.models import ModelConfig, load_model, model_fingerprint
from engine.models.loader import weight_files
from hicache.pools import DeviceKVPool
from hicache_client.errors import ConfigError

CASES: list[tuple[str, dict[str, Any]]] = [
    ("llama", {}),
    ("llama", {"attention_bias": True, "tie_word_embeddings": True}),
    (
        "llama",
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
    ),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    ("qwen2", {}),
    ("qwen3", {"head_dim": 32}),
    ("mistral", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
]


def _reference_logits(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def _pool(model: Any, num_pages: int = 32, page_size: int = 4) -> DeviceKVPool:
    c = model.config
    return DeviceKVPool(num_pages=num_pages, page_size=page_size, num_layers=c.num_layers,
                        kv_heads=c.num_kv_heads, head_dim=c.head_dim)


@pytest.mark.parametrize(("kind", "extra"), CASES, ids=lambda x: str(x))
def test_logits_match_transformers(
    checkpoint_factory: Callable[..., Path], kind: str, extra: dict[str, Any]
) -> None:
    kw = dict(extra)
    if "num_key_value_heads" in kw:
        kw["kv_heads"] = kw.pop("num_key_value_heads")
    path = checkpoint_factory(kind, with_tokenizer=False, **kw)
    ids = torch.randint(0, 1024, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = _reference_logits(path, ids)
    model = load_model(path)
    pool = _pool(model)
    c = model.config
    attn = make_attention_backend("torch", pool, c.num_heads, c.head_dim, c.head_dim**-0.5)
    pages = pool.allocator.alloc(10)
    assert pages is not None
    # Prefill 13 tokens (all logits), a cached-prefix chunk of 14, then decode one at a time.
    rows = [model(ForwardBatch.build(pool, [(ids[:13], 0, pages)], last_only=False), attn)]
    rows.append(model(ForwardBatch.build(pool, [(ids[13:27], 13, pages)], last_only=False), attn))
    for i in range(27, 40):
        rows.append(model(ForwardBatch.build(pool, [(ids[i : i + 1], i, pages)]), attn))
    ours = torch.cat(rows)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_batched_decode_matches_single(checkpoint_factory: Callable[..., Path]) -> None:
    """Requests of different lengths decoded in one padded batch give their solo logits."""
    path = checkpoint_factory("qwen2", with_tokenizer=False)
    model = load_model(path)
    pool = _pool(model, num_pages=64)
    c = model.config
    attn = make_attention_backend("torch", pool, c.num_heads, c.head_dim, c.head_dim**-0.5)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 1024, (n,), generator=g).tolist() for n in (5, 17, 9)]
    tables = [pool.allocator.alloc(6) for _ in seqs]
    solo = []
    for ids in seqs:
        solo.append(_reference_logits(path, ids)[-1])
    # Prefill all but the last token of each as one batch, then one batched decode step.
    model(ForwardBatch.build(pool, [(s[:-1], 0, t) for s, t in zip(seqs, tables)]), attn)
    out = model(ForwardBatch.build(pool, [(s[-1:], len(s) - 1, t) for s, t in zip(seqs, tables)]),
                attn)
    torch.testing.assert_close(out, torch.stack(solo), atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_loads(checkpoint_factory: Callable[..., Path]) -> None:
    path = checkpoint_factory("llama", with_tokenizer=False, max_shard_size="100KB", seed=3)
    assert (path / "model.safetensors.index.json").is_file()
    assert len(weight_files(path)) > 1
    ids = list(range(1, 20))
    model = load_model(path)
    pool = _pool(model)
    c = model.config
    attn = make_attention_backend("torch", pool, c.num_heads, c.head_dim, c.head_dim**-0.5)
    pages = pool.allocator.alloc(5)
    ours = model(ForwardBatch.build(pool, [(ids, 0, pages)], last_only=False), attn)
    torch.testing.assert_close(ours, _reference_logits(path, ids), atol=1e-4, rtol=1e-4)


def test_fingerprint_depends_on_checkpoint(checkpoint_factory: Callable[..., Path]) -> None:
    a = checkpoint_factory("llama", with_tokenizer=False)
    b = checkpoint_factory("qwen2", with_tokenizer=False)
    assert model_fingerprint(a) == model_fingerprint(a)
    assert model_fingerprint(a) != model_fingerprint(b)


def test_config_errors(tmp_path: Path) -> None:
    base = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2}
    with pytest.raises(ConfigError, match="unsupported model_type 'gpt2'"):
        ModelConfig.from_dict({**base, "model_type": "gpt2"})
    with pytest.raises(ConfigError, match="unsupported rope type 'yarn'"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    legacy = ModelConfig.from_dict({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear",
                                                                               "factor": 2.0}})
    assert (legacy.rope_theta, legacy.rope_type, legacy.head_dim) == (5e5, "linear", 4)
    mistral = ModelConfig.from_dict({**base, "model_type": "mistral", "sliding_window": 4096})
    assert mistral.sliding_window == 4096
    qwen2 = ModelConfig.from_dict({**base, "model_type": "qwen2", "sliding_window": 4096})
    assert qwen2.sliding_window is None and qwen2.qkv_bias and not qwen2.o_bias
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(base))
    with pytest.raises(ConfigError, match="no safetensors weights"):
        load_model(tmp_path)


def test_fingerprint_tells_fine_tunes_apart(tmp_path):
    """Same config, same file names and sizes, other weights: another namespace."""
    a, b = tmp_path / "a", tmp_path / "b"
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(a, safe_serialization=True)
    shutil.copytree(a, b)
    assert model_fingerprint(a) == model_fingerprint(b)
    (f,) = weight_files(b)
    tensors = load_file(f)
    name = sorted(tensors)[-1]
    tensors[name] = tensors[name] + 1.0  # a "fine-tune": same shapes, other values
    save_file(tensors, f, metadata={"format": "pt"})
    assert f.stat().st_size == next(iter(weight_files(a))).stat().st_size
    assert model_fingerprint(a) != model_fingerprint(b)
