"""Issue 17 over HTTP on a real `hicache-engine` (demo model), through the `openai` client where
it speaks the field: logprobs (completions with echo, chat, SGLang /generate) streamed and not,
prompt logprobs against the `transformers` forward with the prefix cached and not; penalties,
logit_bias, min_p, min_tokens, max_completion_tokens, seed, stop token ids; response_format and
SGLang's regex / ebnf / json_schema; tools refused; bad specs a 400."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine.demo_model import ensure_demo_model
from tests.engine.test_server_api import EngineServer, engine_server, sse_events

PS = 32  # the default page size
PROMPT = ("Once upon a time there was a small cache that kept every page it ever saw, and the "
          "engine that used it answered each question twice as fast as before, until one day "
          "the pool was full and the oldest pages had to go somewhere else.")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "ok": {"type": "boolean"},
                                           "kind": {"enum": ["a", "b", "c"]}},
          "required": ["name", "ok", "kind"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    with engine_server(tmp_path_factory.mktemp("server-issue17")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: EngineServer) -> Any:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def hf() -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = ensure_demo_model()
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(d), model


def ref_logprobs(hf: tuple[Any, Any], ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf[1](torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def stream(server: EngineServer, path: str, body: dict[str, Any]) -> list[Any]:
    with server.client() as c, c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    return events[:-1]


def post_error(server: EngineServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    with server.client() as c:
        r = c.post(path, json=body)
    assert r.status_code == 400, r.text
    return dict(r.json()["error"])


# ---- logprobs ---------------------------------------------------------------------------------


def test_prompt_logprobs_match_transformers_cached_and_not(server: EngineServer,
                                                           hf: tuple[Any, Any]) -> None:
    ids = hf[0].encode(PROMPT)
    assert len(ids) > 2 * PS
    ref = ref_logprobs(hf, ids)
    server.post("/flush_cache", {})
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2}
    cold = server.post("/v1/completions", body)
    server.post("/v1/completions", {"prompt": ids, "max_tokens": 1})  # now cached
    warm = server.post("/v1/completions", body)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # recomputed
    for out in (cold, warm):
        lp = out["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(ids)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for j in range(1, len(ids)):
            assert lp["token_logprobs"][j] == pytest.approx(float(ref[j - 1, ids[j]]), abs=1e-4)
            # {text: logprob}: two tokens with one text (parts of a character) share a key.
            want = torch.topk(ref[j - 1], 2).values.tolist()
            assert 1 <= len(lp["top_logprobs"][j]) <= 2
            for v in lp["top_logprobs"][j].values():
                assert min(abs(v - w) for w in want) < 1e-4
        assert "".join(lp["tokens"]) == out["choices"][0]["text"]
    # SGLang: from token 40 on; the cache serves the first full page below it.
    start = 40
    gen = server.post("/generate", {"input_ids": ids, "return_logprob": True,
                                    "logprob_start_len": start, "top_logprobs_num": 1,
                                    "sampling_params": {"max_new_tokens": 0}})
    meta = gen["meta_info"]
    assert meta["cached_tokens"] == PS
    got = meta["input_token_logprobs"]
    assert [t for _, t, _ in got] == ids[start:]
    assert [v for v, _, _ in got] == pytest.approx(
        [float(ref[j - 1, ids[j]]) for j in range(start, len(ids))], abs=1e-4)
    assert meta["output_token_logprobs"] == []


def test_completion_output_logprobs_streamed_and_not(server: EngineServer,
                                                     hf: tuple[Any, Any]) -> None:
    body = {"prompt": "The cache", "max_tokens": 6, "logprobs": 3, "ignore_eos": True}
    full = server.post("/v1/completions", body)
    lp = full["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 6
    assert "".join(lp["tokens"]) == full["choices"][0]["text"]
    assert lp["text_offset"][0] == 0
    for v, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) <= 3 and v == pytest.approx(max(top.values()))  # greedy: the top one
    ids = hf[0].encode("The cache")
    out_ids = server.post("/generate", {"text": "The cache", "sampling_params": {
        "max_new_tokens": 6, "ignore_eos": True}})["output_ids"]
    ref = ref_logprobs(hf, ids + out_ids)
    assert lp["token_logprobs"] == pytest.approx(
        [float(ref[len(ids) - 1 + i, t]) for i, t in enumerate(out_ids)], abs=1e-4)
    events = stream(server, "/v1/completions", body)
    chunks = [e["choices"][0]["logprobs"] for e in events if e["choices"]]
    streamed = [v for c in chunks if c for v in c["token_logprobs"]]
    assert streamed == pytest.approx(lp["token_logprobs"])
    assert [o for c in chunks if c for o in c["text_offset"]] == lp["text_offset"]


def test_chat_logprobs_with_openai_client(client: Any) -> None:
    msgs = [{"role": "user", "content": "Say something."}]
    out = client.chat.completions.create(model="x", messages=msgs, max_tokens=5, logprobs=True,
                                         top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob)
        assert bytes(c.bytes) == c.token.encode()
    got = []
    for chunk in client.chat.completions.create(model="x", messages=msgs, max_tokens=5,
                                                logprobs=True, top_logprobs=2, stream=True,
                                                extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            got += chunk.choices[0].logprobs.content
    assert [c.logprob for c in got] == pytest.approx([c.logprob for c in content])
    plain = client.chat.completions.create(model="x", messages=msgs, max_tokens=5)
    assert plain.choices[0].logprobs is None


def test_generate_return_logprob_streamed(server: EngineServer) -> None:
    body = {"text": "Hello", "return_logprob": True, "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    full = server.post("/generate", body)["meta_info"]
    assert len(full["output_token_logprobs"]) == 4
    assert [t for _, t, _ in full["output_token_logprobs"]] == \
        server.post("/generate", body)["output_ids"]
    assert all(isinstance(s, str) for _, _, s in full["output_token_logprobs"])
    assert all(len(x) == 2 for x in full["output_top_logprobs"])
    assert full["input_token_logprobs"] == []
    last = stream(server, "/generate", body)[-1]["meta_info"]
    assert [v for v, _, _ in last["output_token_logprobs"]] == pytest.approx(
        [v for v, _, _ in full["output_token_logprobs"]])


# ---- sampling parameters ---------------------------------------------------------------------


def test_logit_bias_forces_a_token_streamed_and_not(client: Any, hf: tuple[Any, Any]) -> None:
    tok = hf[0].encode(" cache")[-1]
    kw: dict[str, Any] = {"model": "x", "prompt": "Hello", "max_tokens": 4,
                          "logit_bias": {str(tok): 100}, "extra_body": {"ignore_eos": True}}
    text = client.completions.create(**kw).choices[0].text
    assert text == hf[0].decode([tok] * 4)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)
                       if c.choices)
    assert streamed == text
    # The same token as a stop token id: the request ends at once.
    out = client.completions.create(**{**kw, "extra_body": {"stop_token_ids": [tok]}})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 1


def distinct(client: Any, **extra: Any) -> int:
    """Distinct tokens (by text) among 40 greedy ones."""
    out = client.completions.create(model="x", prompt="the the the", max_tokens=40, logprobs=0,
                                    extra_body={"ignore_eos": True, **extra.pop("extra", {})},
                                    **extra)
    assert out.usage.completion_tokens == 40
    return len(set(out.choices[0].logprobs.tokens))


def test_penalties_reduce_repetition(client: Any) -> None:
    base = distinct(client)
    assert base < 40
    assert distinct(client, frequency_penalty=2.0) > base
    assert distinct(client, presence_penalty=2.0) > base
    assert distinct(client, extra={"repetition_penalty": 2.0}) > base
    assert distinct(client, frequency_penalty=-2.0) < base  # a negative one repeats more


def test_min_p_one_is_greedy_and_seed_determinism(client: Any) -> None:
    kw: dict[str, Any] = {"model": "x", "prompt": "A story:", "max_tokens": 12,
                          "extra_body": {"ignore_eos": True}}
    greedy = client.completions.create(**kw).choices[0].text
    kw_t = {**kw, "temperature": 1.0}
    assert client.completions.create(
        **{**kw_t, "seed": 3, "extra_body": {"ignore_eos": True, "min_p": 1.0}},
    ).choices[0].text == greedy
    a = client.completions.create(**kw_t, seed=5).choices[0].text
    b = client.completions.create(**kw_t, seed=5).choices[0].text
    c = client.completions.create(**kw_t, seed=6).choices[0].text
    assert a == b != c
    sa = "".join(x.choices[0].text for x in client.completions.create(**kw_t, seed=5, stream=True)
                 if x.choices)
    assert sa == a


def test_min_tokens_and_max_completion_tokens(client: Any, hf: tuple[Any, Any]) -> None:
    eos = hf[0].eos_token_id
    msgs = [{"role": "user", "content": "Hi"}]
    kw: dict[str, Any] = {"model": "x", "messages": msgs, "logit_bias": {str(eos): 100}}
    assert client.chat.completions.create(**kw).usage.completion_tokens == 1
    out = client.chat.completions.create(**kw, extra_body={"min_tokens": 4})
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "stop"
    out = client.chat.completions.create(model="x", messages=msgs, max_completion_tokens=7,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 7 and out.choices[0].finish_reason == "length"


# ---- structured output ------------------------------------------------------------------------


def test_json_schema_output_validates(client: Any) -> None:
    import jsonschema

    msgs = [{"role": "user", "content": "A record as JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA}}
    for seed in range(3):
        out = client.chat.completions.create(model="x", messages=msgs, max_tokens=200,
                                             temperature=1.0, seed=seed, response_format=rf)
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="x", messages=msgs, max_tokens=200, response_format=rf, stream=True)
        if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    out = client.completions.create(model="x", prompt="JSON:", max_tokens=300,
                                    extra_body={"response_format": {"type": "json_object"}})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].text), dict)
    else:  # a random model may nest deeper than max_tokens: still a JSON object's prefix
        assert out.choices[0].text.startswith("{")


def test_generate_regex_ebnf_json_schema(server: EngineServer) -> None:
    def gen(sp: dict[str, Any], stream_it: bool = False) -> str:
        body = {"text": "Answer:", "sampling_params": {"max_new_tokens": 64, **sp}}
        if stream_it:
            return str(stream(server, "/generate", body)[-1]["text"])
        return str(server.post("/generate", body)["text"])

    for s in (False, True):
        assert re.fullmatch(r"[a-c]{3}-[0-9]", gen({"regex": r"[a-c]{3}-[0-9]"}, s))
        assert gen({"ebnf": 'root ::= "yes" | "no"'}, s) in ("yes", "no")
        json.loads(gen({"json_schema": json.dumps(SCHEMA), "max_new_tokens": 200}, s))


# ---- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 5}}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "a"}}},
     "response_format.json_schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 50, "max_tokens": 5}, "sampling_params"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "(open"}}, None),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{nope"}}, None),
    ("/generate", {"text": "x", "return_logprob": True, "logprob_start_len": 99}, None),
])
def test_bad_values_are_400(server: EngineServer, path: str, body: dict[str, Any],
                            param: str | None) -> None:
    err = post_error(server, path, body)
    if param is not None:
        assert err["param"] == param
    if param == "tools":
        assert "not supported" in err["message"]
