"""The embedded demo model: deterministic files, loadable by transformers, served by `Engine()`."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.attention import ForwardBatch, make_attention_backend
from engine.demo_model import DEMO_ARCH, checkpoint_digest, ensure_demo_model, write_demo_model
from engine.engine import Engine
from engine.models import load_model
from hicache.pools import DeviceKVPool


def test_demo_model_is_deterministic(tmp_path: Path) -> None:
    a = write_demo_model(tmp_path / "a")
    b = write_demo_model(tmp_path / "b")
    assert checkpoint_digest(a) == checkpoint_digest(b)
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["num_hidden_layers"] == DEMO_ARCH["num_hidden_layers"] == 4
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        256, 4, 2)
    # Written once, then reused as is.
    c = ensure_demo_model(tmp_path / "c")
    mtime = (c / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(tmp_path / "c") == c
    assert (c / "model.safetensors").stat().st_mtime_ns == mtime
    assert checkpoint_digest(c) == checkpoint_digest(a)


def test_transformers_loads_the_demo_model() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_demo_model()
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("The cache keeps a copy of something expensive.")["input_ids"]
    assert tok.decode(ids) == "The cache keeps a copy of something expensive."
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|user|>\nhi<|end|>\n<|assistant|>\n"
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    model = load_model(path)
    c = model.config
    pool = DeviceKVPool(num_pages=4, page_size=32, num_layers=c.num_layers,
                        kv_heads=c.num_kv_heads, head_dim=c.head_dim)
    attn = make_attention_backend("torch", pool, c.num_heads, c.head_dim, c.head_dim**-0.5)
    got = model(ForwardBatch.build(pool, [(ids, 0, [0])], last_only=False), attn)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_engine_defaults_to_the_demo_model() -> None:
    with Engine(max_total_tokens=4096) as e:
        assert e.model_path == ensure_demo_model()
        prompt = e.encode_chat([{"role": "user", "content": "Tell me about the river."}])
        a = e.generate(input_ids=prompt, sampling_params={"max_new_tokens": 12})[0]
        b = e.generate("Tell me about the river.", {"max_new_tokens": 12, "temperature": 0.8,
                                                    "seed": 1})[0]
        c = e.generate("Tell me about the river.", {"max_new_tokens": 12, "temperature": 0.8,
                                                    "seed": 1})[0]
    assert a["meta_info"]["completion_tokens"] >= 1
    assert isinstance(a["text"], str)
    assert b == {**c, "meta_info": {**c["meta_info"], "id": b["meta_info"]["id"],
                                    "ttft": b["meta_info"]["ttft"],
                                    "cached_tokens": b["meta_info"]["cached_tokens"]}}
    with Engine(max_total_tokens=4096) as e2:
        again = e2.generate(input_ids=prompt, sampling_params={"max_new_tokens": 12})[0]
    assert again["output_ids"] == a["output_ids"]
