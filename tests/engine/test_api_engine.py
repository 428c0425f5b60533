"""Issue 17 in the engine (no HTTP): prompt and output logprobs against the `transformers`
forward of the same checkpoint, with the prefix cached and not, in one chunk and in many;
structured output, logit bias, min_tokens, seeds and bad specs through `Engine.add_request`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.engine import Engine

PROMPT = ("The quick brown fox jumps over the lazy dog, and then the dog sleeps in the sun "
          "while the fox runs back to the forest.")


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[Engine]:
    with Engine(model_path=str(tiny_model), page_size=4, max_total_tokens=4096,
                chunked_prefill_size=16, dtype="float32", device="cpu") as e:
        yield e


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model: Path, engine: Engine) -> tuple[list[int], torch.Tensor]:
    """(prompt ids, log_softmax of the transformers forward [n, vocab]) in float32."""
    from transformers import AutoModelForCausalLM

    ids = engine.tokenizer.encode(PROMPT)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, dim=-1)


def run(engine: Engine, ids: list[int], params: dict[str, Any], **kw: Any) -> dict[str, Any]:
    """Run one request to the end; its output ids, finish reason and the logprobs gathered."""
    rid = engine.add_request(input_ids=ids, sampling_params=params, **kw)
    out: dict[str, Any] = {"output": [], "lp": {"output": [], "output_top": []}}
    while True:
        for u in engine.step():
            if u["rid"] != rid:
                continue
            lp = u["logprobs"]
            if lp is not None:
                out["lp"]["output"] += lp["output"]
                out["lp"]["output_top"] += lp["output_top"]
                for k in ("prompt", "prompt_top", "prompt_start"):
                    if k in lp:
                        assert k not in out["lp"], "prompt logprobs reported twice"
                        out["lp"][k] = lp[k]
            if u["finished"]:
                out["output"] = u["output_ids"]
                out["text"] = u["text"]
                out["meta"] = u["meta_info"]
                return out


def check_prompt(got: dict[str, Any], ids: list[int], ref: torch.Tensor, start: int,
                 top_k: int) -> None:
    assert got["prompt_start"] == start
    prompt, tops = got["prompt"], got["prompt_top"]
    assert len(prompt) == len(ids) - start
    for j in range(start, len(ids)):
        val, top = prompt[j - start], tops[j - start]
        if j == 0:
            assert val is None and top is None
            continue
        row = ref[j - 1]
        assert val == pytest.approx(float(row[ids[j]]), abs=1e-4)
        want = torch.topk(row, top_k)
        assert [t for t, _ in top] == want.indices.tolist()
        assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("start", [0, 9, 30])
def test_prompt_logprobs_match_transformers_cached_and_not(
        engine: Engine, hf_logprobs: tuple[list[int], torch.Tensor], start: int) -> None:
    ids, ref = hf_logprobs
    engine.flush_cache()
    uncached = run(engine, ids, {"max_new_tokens": 0}, return_logprob=True,
                   top_logprobs_num=3, logprob_start_len=start)
    assert uncached["meta"]["cached_tokens"] == 0
    check_prompt(uncached["lp"], ids, ref, start, 3)
    # The whole prompt is now cached: the prompt positions asked for are recomputed.
    warm = run(engine, ids, {"max_new_tokens": 0})
    assert warm["meta"]["cached_tokens"] == (len(ids) - 1) // 4 * 4
    cached = run(engine, ids, {"max_new_tokens": 0}, return_logprob=True,
                 top_logprobs_num=3, logprob_start_len=start)
    assert cached["meta"]["cached_tokens"] == max(start - 1, 0) // 4 * 4
    check_prompt(cached["lp"], ids, ref, start, 3)
    assert cached["lp"]["prompt"][1:] == pytest.approx(uncached["lp"]["prompt"][1:], abs=1e-5)


def test_output_logprobs_match_transformers(
        engine: Engine, tiny_model: Path, hf_logprobs: tuple[list[int], torch.Tensor]) -> None:
    from transformers import AutoModelForCausalLM

    ids, _ = hf_logprobs
    got = run(engine, ids, {"max_new_tokens": 6, "ignore_eos": True}, return_logprob=True,
              top_logprobs_num=2)
    assert "prompt" not in got["lp"]
    out = got["output"]
    assert len(got["lp"]["output"]) == len(out) == 6
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), torch_dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids + out])).logits[0].float(), dim=-1)
    for i, tok in enumerate(out):
        row = ref[len(ids) - 1 + i]
        assert tok == int(row.argmax())  # greedy
        assert got["lp"]["output"][i] == pytest.approx(float(row[tok]), abs=1e-4)
        assert [t for t, _ in got["lp"]["output_top"][i]] == torch.topk(row, 2).indices.tolist()


def test_greedy_unchanged_by_logprobs(engine: Engine,
                                      hf_logprobs: tuple[list[int], torch.Tensor]) -> None:
    ids, _ = hf_logprobs
    plain = run(engine, ids, {"max_new_tokens": 8, "ignore_eos": True})
    with_lp = run(engine, ids, {"max_new_tokens": 8, "ignore_eos": True}, return_logprob=True,
                  logprob_start_len=0)
    assert plain["output"] == with_lp["output"]


def test_logit_bias_forces_a_token_and_min_tokens(engine: Engine) -> None:
    ids = engine.tokenizer.encode("Hello there")
    forced = run(engine, ids, {"max_new_tokens": 5, "logit_bias": {"77": 100.0}})
    assert forced["output"] == [77] * 5
    eos = min(engine.eos_token_ids)
    # EOS forced by a bias still waits for min_tokens; then it ends the request at once.
    got = run(engine, ids, {"max_new_tokens": 10, "min_tokens": 3, "logit_bias": {eos: 100}})
    assert len(got["output"]) == 4 and got["output"][-1] == eos
    assert eos not in got["output"][:3]
    assert got["meta"]["finish_reason"]["type"] == "stop"


def test_json_schema_output_validates(engine: Engine) -> None:
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "ok": {"type": "boolean"},
                                               "kind": {"enum": ["a", "b", "c"]}},
              "required": ["name", "ok", "kind"], "additionalProperties": False}
    ids = engine.tokenizer.encode("Give JSON:")
    for seed in range(3):
        got = run(engine, ids, {"max_new_tokens": 200, "json_schema": json.dumps(schema),
                                "temperature": 1.0, "seed": seed})
        assert got["meta"]["finish_reason"]["type"] == "stop"
        jsonschema.validate(json.loads(got["text"]), schema)


def test_seed_is_deterministic(engine: Engine) -> None:
    ids = engine.tokenizer.encode("Once upon a time")
    p = {"max_new_tokens": 12, "temperature": 1.0, "seed": 1234, "ignore_eos": True}
    a, b = run(engine, ids, p), run(engine, ids, p)
    c = run(engine, ids, {**p, "seed": 99})
    assert a["output"] == b["output"]
    assert a["output"] != c["output"]


@pytest.mark.parametrize("kw,msg", [
    ({"sampling_params": {"logit_bias": {"999999": 1}}}, "outside the vocabulary"),
    ({"sampling_params": {"json_schema": "{not json"}}, "invalid json_schema"),
    ({"sampling_params": {"regex": "(unclosed"}}, "invalid regex"),
    ({"return_logprob": True, "logprob_start_len": 500}, "logprob_start_len"),
    ({"return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
])
def test_bad_specs_are_refused_at_admission(engine: Engine, kw: dict[str, Any],
                                            msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        engine.add_request(input_ids=[1, 2, 3], **kw)
    assert not engine.has_unfinished()


def test_prefill_rows_plan() -> None:
    from engine.req_logprobs import ReqLogprobs, prefill_rows

    plain = ReqLogprobs.make(2, -1, 10)  # output logprobs only: nothing pending
    assert plain.cache_limit(9) == 9 and not plain.prompt_pending
    assert prefill_rows([(None, 0, 5), (plain, 3, 7)]) is None
    a = ReqLogprobs.make(0, 0, 10)  # positions 0..8 are needed
    b = ReqLogprobs.make(1, 6, 10)  # positions 5..8
    assert (a.prompt, a.next_pos, b.prompt, b.next_pos) == ([None], 0, [], 5)
    assert a.cache_limit(9) == 0 and b.cache_limit(9) == 5
    # a: a first chunk of 6 (positions 0..5); b: positions 4..9 (the last is the prompt's end).
    rows, last, spans = prefill_rows([(None, 0, 3), (a, 0, 6), (b, 4, 6)])  # type: ignore[misc]
    assert rows == [2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14]
    assert last == [0, 6, 11]
    assert spans == [(0, 0), (1, 6), (7, 4)]
    with pytest.raises(RuntimeError):
        prefill_rows([(b, 6, 4)])  # position 5 was never computed


def test_logprobs_travel_in_protocol_messages(engine: Engine) -> None:
    from engine.server import protocol as P

    ids = engine.tokenizer.encode(PROMPT)[:12]
    rid = engine.add_request(input_ids=ids, sampling_params={"max_new_tokens": 2},
                             return_logprob=True, top_logprobs_num=2, logprob_start_len=0)
    lp: dict[str, Any] | None = None
    while lp is None:
        lp = next((u["logprobs"] for u in engine.step() if u["rid"] == rid), None)
    while engine.has_unfinished():
        engine.step()
    out = P.ReqOut(rid=rid, new_token_ids=[1], finished=False, finish_reason=None,
                   prompt_tokens=12, completion_tokens=1, cached_tokens=0, logprobs=lp)
    back = P.decode(P.encode(out))
    assert back == out and back.logprobs["prompt"][0] is None
    assert len(back.logprobs["prompt"]) == 12 and len(back.logprobs["output"]) == 1
    req = P.GenerateReq(rid="r", input_ids=ids, sampling_params={"logit_bias": {"5": 1.0}},
                        logprobs={"top_logprobs_num": 2, "logprob_start_len": 0})
    assert P.decode(P.encode(req)) == req
