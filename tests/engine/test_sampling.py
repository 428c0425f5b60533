"""Sampling: greedy, seeded temperature / top-k / top-p, stop strings and token ids."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from engine.sampling import SamplingParams, sample
from hicache_client.errors import ConfigError

PROMPT = list(range(40, 72))


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[Engine]:
    with Engine(model_path=str(tiny_model), page_size=4, max_total_tokens=2048) as e:
        yield e


def _ids(engine: Engine, **params: object) -> list[int]:
    return engine.generate(input_ids=PROMPT, sampling_params=params)[0]["output_ids"]


def test_seeded_sampling_is_reproducible(engine: Engine) -> None:
    p = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    a = _ids(engine, seed=5, **p)
    assert a == _ids(engine, seed=5, **p)
    assert a != _ids(engine, seed=6, **p)
    # Batched with other requests, a seeded request samples the same tokens.
    out = engine.generate(input_ids=[PROMPT, PROMPT[:20], PROMPT],
                          sampling_params=[{**p, "seed": 5}, {**p, "seed": 9}, {**p, "seed": 5}])
    assert out[0]["output_ids"] == out[2]["output_ids"] == a


def test_top_k_one_and_tiny_top_p_are_greedy(engine: Engine) -> None:
    greedy = _ids(engine, max_new_tokens=10, ignore_eos=True)
    assert _ids(engine, max_new_tokens=10, ignore_eos=True, temperature=1.5, top_k=1,
                seed=1) == greedy
    assert _ids(engine, max_new_tokens=10, ignore_eos=True, temperature=1.5, top_p=1e-6,
                seed=2) == greedy


def test_stop_token_ids_and_strings(engine: Engine) -> None:
    full = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 12,
                                                               "ignore_eos": True})[0]
    ids = full["output_ids"]
    stop_tok = ids[4]
    first = ids.index(stop_tok)
    r = engine.generate(input_ids=PROMPT, sampling_params={
        "max_new_tokens": 12, "ignore_eos": True, "stop_token_ids": [stop_tok]})[0]
    assert r["output_ids"] == ids[: first + 1]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.find(stop)
    r = engine.generate(input_ids=PROMPT, sampling_params={
        "max_new_tokens": 12, "ignore_eos": True, "stop": [stop]})[0]
    assert r["text"] == text[:cut]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_eos_stops_unless_ignored(engine: Engine) -> None:
    ids = _ids(engine, max_new_tokens=6, ignore_eos=True)
    # Pretend the 3rd greedy token is an EOS of the model.
    engine.scheduler.eos_token_ids.add(ids[2])
    try:
        r = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 6})[0]
        assert r["output_ids"] == ids[: ids.index(ids[2]) + 1]
        assert r["meta_info"]["finish_reason"]["type"] == "stop"
        assert _ids(engine, max_new_tokens=6, ignore_eos=True) == ids
    finally:
        engine.scheduler.eos_token_ids.discard(ids[2])


def test_max_new_tokens_zero_and_meta(engine: Engine) -> None:
    r = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 0})[0]
    assert r["output_ids"] == []
    assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    r = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 3,
                                                            "ignore_eos": True})[0]
    meta = r["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(PROMPT), 3)
    assert meta["cached_tokens"] == (len(PROMPT) - 1) // 4 * 4  # the prefix cached above


def test_sampler_unit() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.9], [3.0, 0.0, 0.0, 0.0]])
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=2, seed=0)]
    gens = [None, torch.Generator().manual_seed(0)]
    assert sample(logits, params, gens)[0] == 1
    draws = {sample(logits[1:], params[1:], [torch.Generator().manual_seed(s)])[0]
             for s in range(50)}
    assert draws <= {0, 1, 2, 3} and 0 in draws
    top_p = SamplingParams(temperature=1.0, top_p=0.5)
    for s in range(20):
        assert sample(logits[:1], [top_p], [torch.Generator().manual_seed(s)]) == [1]


def test_sampling_params_validation() -> None:
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ConfigError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ConfigError, match="top_k"):
        SamplingParams(top_k=0)
    with pytest.raises(ConfigError, match="unknown sampling parameters: bogus"):
        SamplingParams.from_any({"bogus": 1})
    assert SamplingParams(stop="x").stop == ["x"]


def test_degenerate_parameters_sample_or_refuse_cleanly():
    logits = torch.randn(3, 50)
    params = [
        SamplingParams(temperature=1e-300),
        SamplingParams(temperature=0.7, top_p=1e-300),
        SamplingParams(temperature=1e-38),
    ]
    gens = [torch.Generator().manual_seed(0) for _ in params]
    assert sample(logits, params, gens) == logits.argmax(-1).tolist()
    for bad in (dict(temperature=math.nan), dict(temperature=math.inf), dict(top_p=math.nan)):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)
