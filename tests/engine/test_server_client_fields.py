"""What real clients send, on a real `hicache-engine` (demo model): every row of
`engine.server.request_fields` does what it says (honoured: the request models declare it;
default only: its default is taken and another value refused naming it; any value: taken);
one 400 names every refused field, is logged at INFO and counted in `/metrics`; the openai SDK's
current fields; vLLM's fields the engine honours (`continuous_usage_stats`,
`include_stop_str_in_output`, `allowed_token_ids`, `bad_words`, `prompt_logprobs`,
`return_tokens_as_token_ids`, `truncate_prompt_tokens`, `add_special_tokens`,
`add_generation_prompt`, `continue_final_message`, chat `echo`, `structured_outputs`,
`request_id`); SGLang's list forms of one request."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pydantic import BaseModel

from engine.demo_model import ensure_demo_model
from engine.sampling import Sampler, SamplingParams
from engine.server import request_fields as RF
from engine.server import schemas as S
from tests.engine.test_server_api import EngineServer, engine_server, sse_events

MODELS: dict[str, type[BaseModel]] = {
    RF.COMPLETION: S.CompletionBody, RF.CHAT: S.ChatBody, RF.GENERATE: S.GenerateBody,
    RF.SAMPLING: S.GenerateSampling, RF.STREAM_OPTIONS: S.StreamOptions,
    RF.STRUCTURED: S.StructuredOutputs, RF.MESSAGE: S.ChatMessage,
}
USER = {"role": "user", "content": "Which pier floods first?"}
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    with engine_server(tmp_path_factory.mktemp("client-fields"), ["--enable-metrics"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_demo_model())


def _declared(model: type[BaseModel]) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


def test_the_models_declare_exactly_the_honoured_rows() -> None:
    for where, model in MODELS.items():
        honoured = {n for n, row in RF.TABLES[where].items() if row.honoured}
        assert _declared(model) == honoured, where
    kinds = {row.kind for table in RF.TABLES.values() for row in table.values()}
    assert kinds == {RF.HONOURED, RF.DEFAULT_ONLY, RF.ANY_VALUE}


# Fields the bodies of _body() set themselves.
BASE_FIELDS = {RF.GENERATE: ("text", "sampling_params"), RF.SAMPLING: ("max_new_tokens",),
               RF.STRUCTURED: ("regex",), RF.COMPLETION: ("max_tokens",),
               RF.CHAT: ("max_tokens",)}


def _refused_value(row: RF.Row) -> Any:
    for v in ("not-the-default", 7, True, False, {"k": 1}, ["x"]):
        if not row.takes(v):
            return v
    raise AssertionError(f"{row.name} takes every value but is {row.kind}")


def _body(where: str, name: str, value: Any) -> tuple[str, dict[str, Any], str]:
    comp = {"prompt": "Hi", "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    gen: dict[str, Any] = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
    if where == RF.COMPLETION:
        return "/v1/completions", {**comp, name: value}, name
    if where == RF.CHAT:
        return "/v1/chat/completions", {**chat, name: value}, name
    if where == RF.GENERATE:
        return "/generate", {**gen, name: value}, name
    if where == RF.SAMPLING:
        return "/generate", {**gen, "sampling_params": {"max_new_tokens": 2, name: value}}, \
            f"sampling_params.{name}"
    if where == RF.STREAM_OPTIONS:
        return "/v1/chat/completions", {**chat, "stream": True,
                                        "stream_options": {name: value}}, f"stream_options.{name}"
    if where == RF.STRUCTURED:
        return "/v1/chat/completions", {**chat, "structured_outputs": {
            "regex": "[ab]", name: value}}, f"structured_outputs.{name}"
    assert where == RF.MESSAGE
    return "/v1/chat/completions", {**chat, "messages": [
        {"role": "user", "content": "Hi", name: value}]}, f"messages.0.{name}"


def test_every_row_does_what_it_says(server: EngineServer) -> None:
    counts = {RF.HONOURED: 0, RF.DEFAULT_ONLY: 0, RF.ANY_VALUE: 0}
    with server.client() as c:
        for where, table in RF.TABLES.items():
            for name, row in table.items():
                counts[row.kind] += 1
                if row.honoured:
                    # Declared by the models (above); sent at the model's default it passes
                    # (vLLM's clients send their defaults, nulls included). Effects: below.
                    field = {f.alias or n: f for n, f in MODELS[where].model_fields.items()}[name]
                    if field.is_required() or name in BASE_FIELDS.get(where, ()):
                        continue
                    path, body, _ = _body(where, name, field.get_default(call_default_factory=True))
                    r = c.post(path, json=body)
                    assert r.status_code == 200, (where, name, r.text)
                    continue
                if row.kind == RF.ANY_VALUE:
                    value = "a name" if row.takes("a name") else {"key": "a name"}
                    path, body, _ = _body(where, name, value)
                    r = c.post(path, json=body)
                    assert r.status_code == 200, (where, name, r.text)
                    continue
                path, body, param = _body(where, name, row.default)
                r = c.post(path, json=body)
                assert r.status_code == 200, (where, name, row.default, r.text)
                value = _refused_value(row)
                path, body, param = _body(where, name, value)
                r = c.post(path, json=body)
                assert r.status_code == 400, (where, name, value, r.text)
                err = r.json()["error"]
                assert (err["param"], err["code"]) == (param, "unsupported_parameter"), err
                assert row.asks in err["message"]
    assert counts[RF.DEFAULT_ONLY] > 100 and counts[RF.HONOURED] > 100, counts


# vLLM's request fields at vLLM's own defaults (its CompletionRequest / ChatCompletionRequest),
# the ones issue 37 found refused.
VLLM_DEFAULTS: dict[str, Any] = {
    "add_special_tokens": True, "echo": False, "include_stop_str_in_output": False,
    "use_beam_search": False, "length_penalty": 1.0, "truncate_prompt_tokens": None,
    "prompt_logprobs": None, "allowed_token_ids": None, "bad_words": [],
    "logits_processors": None, "return_tokens_as_token_ids": None, "kv_transfer_params": None,
    "vllm_xargs": None, "structured_outputs": None, "spaces_between_special_tokens": True,
    "priority": 0, "request_id": "vllm-req", "skip_special_tokens": True, "min_tokens": 0,
    "ignore_eos": False, "stop_token_ids": [], "cache_salt": None, "response_format": None,
    "stream_options": {"include_usage": True, "continuous_usage_stats": False},
}
VLLM_CHAT = {"add_generation_prompt": True, "add_special_tokens": False,
             "continue_final_message": False, "documents": None, "chat_template": None,
             "chat_template_kwargs": None, "mm_processor_kwargs": None}


def test_vllm_bodies_at_their_defaults(server: EngineServer) -> None:
    comp = {"prompt": "Hello", "max_tokens": 3, **GREEDY}
    chat = {"messages": [USER], "max_tokens": 3, **GREEDY}
    for path, body, plain in (
            ("/v1/completions", {**comp, **VLLM_DEFAULTS, "prompt_embeds": None}, comp),
            ("/v1/chat/completions", {**chat, **VLLM_DEFAULTS, **VLLM_CHAT}, chat)):
        out = server.post(path, body)
        ref = server.post(path, plain)
        assert out["choices"] == ref["choices"] and out["usage"] == ref["usage"]
        assert out["id"].endswith("-vllm-req")
        events = _stream(server, path, body)
        assert events[-1]["usage"] == ref["usage"]


def test_one_refusal_names_every_field_logs_and_counts(server: EngineServer) -> None:
    body = {"messages": [USER], "store": True, "tools": [{"type": "function"}],
            "no_such_field": 1, "other_unknown": 2, "service_tier": "flex"}
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "unsupported_parameter"
        assert err["param"] == "store, tools, service_tier, no_such_field, other_unknown"
        for word in ("storing the completion", "tool calling", "a paid service tier",
                     "unknown fields"):
            assert word in err["message"], err
        # Unknown fields alone: one 400 naming both.
        r = c.post("/v1/completions", json={"prompt": "x", "no_such_field": 1, "zz": 2})
        assert r.status_code == 400
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (
            "unknown_field", "no_such_field, zz")
        # Many unknown fields, one with a newline in its name: one escaped, bounded log line.
        many = {"bad\nname": 1} | {f"x{i:02d}": 1 for i in range(25)}
        r = c.post("/v1/completions", json={"prompt": "x", **many})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("bad\nname, x00")
        metrics = c.get("/metrics").text
    log = server.proc.log()
    assert ("refused POST /v1/completions: 400 unknown_field (bad\\nname, x00, x01, x02, x03, "
            "x04, x05, x06, x07, x08, x09, x10, x11, x12, x13, x14, x15, x16, x17, x18 and 6 "
            "more)") in log
    assert "bad\nname" not in log
    line = ('refused /v1/chat/completions: 400 unsupported_parameter '
            '(store, tools, service_tier, no_such_field, other_unknown)')
    assert f"INFO engine.server.frontend: refused POST {line[8:]}" in server.proc.log()
    assert "Which pier" not in server.proc.log()  # no prompt text in the log
    got = {m.group(1, 2): float(m.group(3)) for m in re.finditer(
        r'hicache:refused_request_fields_total\{field="([^"]+)",reason="(\w+)"\} (\S+)', metrics)}
    assert got[("store", "unsupported")] >= 1 and got[("service_tier", "unsupported")] >= 1
    assert got[("no_such_field", "unknown")] >= 2 and got[("zz", "unknown")] >= 1


def test_openai_sdk_current_fields(server: EngineServer) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    extra = {"store": False, "metadata": {"team": "docs"}, "prompt_cache_key": "tenant-1",
             "service_tier": "auto", "safety_identifier": "hash-123", "user": "ann"}
    chat = client.chat.completions.create(
        model="hicache-demo", messages=[USER], max_completion_tokens=4, temperature=0,
        **extra)  # type: ignore[call-overload]
    ref = server.post("/v1/chat/completions", {"messages": [USER], "max_tokens": 4,
                                               "temperature": 0})
    assert chat.choices[0].message.content == ref["choices"][0]["message"]["content"]
    stream = client.chat.completions.create(
        model="hicache-demo", messages=[USER], max_completion_tokens=4, temperature=0,
        stream=True, stream_options={"include_usage": True}, **extra)  # type: ignore
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        ref["choices"][0]["message"]["content"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == \
        ref["usage"]["completion_tokens"]
    comp = client.completions.create(model="hicache-demo", prompt="Hello", max_tokens=3,
                                     temperature=0, user="ann",
                                     extra_body={"store": False, "metadata": {"a": "b"}})
    assert comp.usage is not None and comp.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="hicache-demo", messages=[USER], store=True,
                                       max_completion_tokens=2)  # type: ignore
    assert e.value.status_code == 400 and "store" in str(e.value)


def _stream(server: EngineServer, path: str, body: dict[str, Any]) -> list[Any]:
    with server.client() as c, c.stream("POST", path, json={**body, "stream": True}) as s:
        assert s.status_code == 200, s.read()
        events = sse_events(s.iter_lines())
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_continuous_usage_stats(server: EngineServer) -> None:
    so = {"include_usage": True, "continuous_usage_stats": True}
    for path, body, count in (
            ("/v1/completions", {"prompt": "Hello there", "max_tokens": 5, **GREEDY},
             lambda e: e["choices"][0]["text"]),
            ("/v1/chat/completions", {"messages": [USER], "max_tokens": 5, **GREEDY},
             lambda e: e["choices"][0]["delta"].get("content"))):
        whole = server.post(path, body)
        events = _stream(server, path, {**body, "stream_options": so})
        prompt = whole["usage"]["prompt_tokens"]
        assert all(e["usage"]["prompt_tokens"] == prompt for e in events)
        assert all(e["usage"]["total_tokens"] == prompt + e["usage"]["completion_tokens"]
                   for e in events)
        done = [e["usage"]["completion_tokens"] for e in events[:-1]]
        assert done == sorted(done) and done[-1] == 5
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
        assert any(count(e) for e in events[:-1])
        # include_usage alone: usage only in the last chunk (as before).
        plain = _stream(server, path, {**body, "stream_options": {"include_usage": True}})
        assert all("usage" not in e for e in plain[:-1]) and plain[-1]["usage"] == \
            events[-1]["usage"]


def test_return_cached_tokens_details(server: EngineServer) -> None:
    """Opt-in per-request miss attribution in the usage (issue 48): every prompt token comes to
    one outcome, summing to prompt_tokens; a repeat's cached tokens are its device hits; off by
    default; n > 1 is a 400 naming the field."""
    body = {"messages": [{"role": "user", "content": "Details of the tide cache, please: " * 6}],
            "max_tokens": 3, **GREEDY, "return_cached_tokens_details": True}
    first = server.post("/v1/chat/completions", body)["usage"]
    again = server.post("/v1/chat/completions", body)["usage"]
    for u in (first, again):
        outcomes = u["prompt_tokens_details"]["cache_outcomes"]
        assert sum(outcomes.values()) == u["prompt_tokens"], u
    assert first["prompt_tokens_details"]["cache_outcomes"].get("device_hit", 0) == \
        first["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["prompt_tokens_details"]["cache_outcomes"]["device_hit"] == \
        again["prompt_tokens_details"]["cached_tokens"] > 0
    events = _stream(server, "/v1/chat/completions",
                     {**body, "stream_options": {"include_usage": True}})
    assert events[-1]["usage"]["prompt_tokens_details"] == again["prompt_tokens_details"]
    plain = server.post("/v1/completions", {"prompt": "The tide", "max_tokens": 2, **GREEDY})
    assert "cache_outcomes" not in plain["usage"]["prompt_tokens_details"]
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "The tide", "max_tokens": 2, "n": 2,
                                             "return_cached_tokens_details": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == \
            "return_cached_tokens_details", r.text
        r = c.post("/v1/completions", json={"prompt": "The tide", "max_tokens": 2,
                                             "return_cached_tokens_details": "yes"})
        assert r.status_code == 400 and "return_cached_tokens_details" in r.text, r.text


def _comp(server: EngineServer, **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = server.post("/v1/completions", {
        "prompt": "The tide table lists", "max_tokens": 12, **GREEDY, **kw})
    return out


def test_vllm_sampling_fields(server: EngineServer, tok: Any) -> None:
    base = _comp(server)
    text = base["choices"][0]["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert _comp(server, stop=[stop], include_stop_str_in_output=True)["choices"][0]["text"] == \
        _comp(server, stop=[stop], no_stop_trim=True)["choices"][0]["text"]
    assert stop in _comp(server, stop=[stop],
                         include_stop_str_in_output=True)["choices"][0]["text"]
    # allowed_token_ids: every generated token is one of them.
    allowed = [tok.convert_tokens_to_ids(t) for t in ("a", "b", "c")]
    out = server.post("/generate", {"text": "The tide table lists", "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
    got = _comp(server, allowed_token_ids=allowed, logprobs=0, return_tokens_as_token_ids=True)
    ids = [int(t.split(":")[1]) for t in got["choices"][0]["logprobs"]["tokens"]]
    assert len(ids) == 12 and set(ids) <= set(allowed)
    # bad_words: the greedy output's first word never appears once banned.
    word = tok.decode(out["output_ids"][:1]).strip()
    assert word
    banned = _comp(server, bad_words=[word], logprobs=0, return_tokens_as_token_ids=True)
    banned_ids = [int(t.split(":")[1]) for t in banned["choices"][0]["logprobs"]["tokens"]]
    for seq in (tok(word, add_special_tokens=False)["input_ids"],
                tok(" " + word, add_special_tokens=False)["input_ids"]):
        assert not any(banned_ids[i:i + len(seq)] == seq for i in range(len(banned_ids)))
    assert banned_ids != out["output_ids"][:12]
    with server.client() as c:
        for bad_body, param in (({"allowed_token_ids": [10 ** 9]}, None),
                                ({"allowed_token_ids": []}, "allowed_token_ids"),
                                ({"bad_words": [" "]}, "bad_words")):
            r = c.post("/v1/completions", json={"prompt": "x", **bad_body})
            assert r.status_code == 400, (bad_body, r.text)
            if param is not None:
                assert r.json()["error"]["param"] == param
            else:
                assert "outside the vocabulary" in r.json()["error"]["message"]
    # Unused, the output is the plain greedy one.
    assert _comp(server, bad_words=[], allowed_token_ids=None)["choices"][0]["text"] == text


def test_prompt_logprobs_and_token_ids(server: EngineServer, tok: Any) -> None:
    prompt_ids = tok("The tide table lists")["input_ids"]
    out = _comp(server, prompt_logprobs=2, max_tokens=2)
    echo = _comp(server, echo=True, logprobs=2, max_tokens=2)
    choice = out["choices"][0]
    assert choice["logprobs"] is None
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(prompt_ids) and plp[0] is None
    want = echo["choices"][0]["logprobs"]["token_logprobs"][:len(prompt_ids)]
    for j, tid in enumerate(prompt_ids[1:], 1):
        entry = plp[j]
        assert entry[str(tid)]["logprob"] == pytest.approx(want[j])
        assert entry[str(tid)]["decoded_token"] == tok.decode([tid])
        assert len(entry) in (2, 3)
        assert sorted(v["rank"] for k, v in entry.items() if k != str(tid) or
                      v["rank"] is not None)[:2] == [1, 2]
    chat = server.post("/v1/chat/completions", {"messages": [USER], "max_tokens": 2,
                                                "prompt_logprobs": 0, "logprobs": True,
                                                "top_logprobs": 1,
                                                "return_tokens_as_token_ids": True, **GREEDY})
    c0 = chat["choices"][0]
    assert len(c0["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in c0["prompt_logprobs"][1:])
    content = c0["logprobs"]["content"]
    assert len(content) == 2 and all(re.fullmatch(r"token_id:\d+", e["token"]) for e in content)
    assert all(len(e["top_logprobs"]) == 1 for e in content)


def test_prompt_shaping_fields(server: EngineServer, tok: Any) -> None:
    prompt = "The tide table lists the hours of high water at every pier"
    ids = tok(prompt)["input_ids"]
    gen = {"sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    # truncate_prompt_tokens: the last k tokens are the prompt.
    cut = _comp(server, prompt=prompt, truncate_prompt_tokens=5, max_tokens=6)
    assert cut["usage"]["prompt_tokens"] == 5
    assert cut["choices"][0]["text"] == server.post("/generate", {"input_ids": ids[-5:],
                                                                  **gen})["text"]
    # add_special_tokens: false leaves out BOS (the demo tokenizer adds none: the same ids).
    no_bos = tok(prompt, add_special_tokens=False)["input_ids"]
    plain = _comp(server, prompt=prompt, add_special_tokens=False, max_tokens=6)
    assert plain["usage"]["prompt_tokens"] == len(no_bos)
    assert plain["choices"][0]["text"] == server.post("/generate", {"input_ids": no_bos,
                                                                    **gen})["text"]
    # Chat: add_generation_prompt false, continue_final_message (vLLM's way), truncation.
    msgs = [USER, {"role": "assistant", "content": "The first pier"}]
    for kw in ({"add_generation_prompt": False},
               {"add_generation_prompt": False, "continue_final_message": True}):
        want = tok.apply_chat_template(msgs, tokenize=False, **kw)
        want_ids = tok(want, add_special_tokens=False)["input_ids"]
        out = server.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 6,
                                                   **GREEDY, **kw})
        assert out["usage"]["prompt_tokens"] == len(want_ids), kw
        assert out["choices"][0]["message"]["content"] == server.post(
            "/generate", {"input_ids": want_ids, **gen})["text"]
    full = server.post("/v1/chat/completions", {"messages": [USER], "max_tokens": 2})
    with_bos = server.post("/v1/chat/completions", {"messages": [USER], "max_tokens": 2,
                                                    "add_special_tokens": True})
    extra_bos = 1 if tok.bos_token_id is not None and tok("x")["input_ids"][0] == \
        tok.bos_token_id else 0
    assert with_bos["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"] + extra_bos
    short = server.post("/v1/chat/completions", {"messages": [USER], "max_tokens": 2,
                                                 "truncate_prompt_tokens": 4})
    assert short["usage"]["prompt_tokens"] == 4
    # Chat echo (vLLM's): a last message of the answer's role comes first; a user's does not.
    cont = {"messages": msgs, "max_tokens": 4, **GREEDY, "continue_final_message": True}
    plain_cont = server.post("/v1/chat/completions", cont)["choices"][0]["message"]["content"]
    echoed = server.post("/v1/chat/completions", {**cont, "echo": True})["choices"][0]
    assert echoed["message"] == {"role": "assistant", "content": "The first pier" + plain_cont}
    events = _stream(server, "/v1/chat/completions", {**cont, "echo": True})
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == \
        echoed["message"]["content"]
    user_last = {"messages": [USER], "max_tokens": 2, **GREEDY}
    assert server.post("/v1/chat/completions", {**user_last, "echo": True})["choices"][0][
        "message"]["content"] == server.post("/v1/chat/completions", user_last)["choices"][0][
        "message"]["content"]
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "x", "truncate_prompt_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_structured_outputs_and_names(server: EngineServer) -> None:
    chat = {"messages": [USER], "max_tokens": 24, "temperature": 0}
    choice = server.post("/v1/chat/completions", {
        **chat, "structured_outputs": {"choice": ["north pier", "south \"pier\""]}})
    assert choice["choices"][0]["message"]["content"] in ("north pier", 'south "pier"')
    old = server.post("/v1/chat/completions", {**chat, "guided_choice": ["yes", "no"]})
    assert old["choices"][0]["message"]["content"] in ("yes", "no")
    rx = server.post("/v1/completions", {"prompt": "Number:", "max_tokens": 8,
                                         "temperature": 0,
                                         "structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", rx["choices"][0]["text"])
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    js = server.post("/v1/chat/completions", {**chat, "max_tokens": 40,
                                              "structured_outputs": {"json": schema}})
    assert isinstance(json.loads(js["choices"][0]["message"]["content"])["n"], int)
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={**chat, "structured_outputs": {
            "regex": "a", "choice": ["b"]}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.choice"
    # request_id (vLLM's), rid and extra_key as SGLang's one-element lists, priority 0,
    # lora_path [null].
    named = server.post("/v1/chat/completions", {**chat, "max_tokens": 2,
                                                 "request_id": "abc", "priority": 0})
    assert named["id"] == "chatcmpl-abc"
    comp = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2,
                                           "request_id": "abc"})
    assert comp["id"] == "cmpl-abc"
    listed = server.post("/v1/chat/completions", {**chat, "max_tokens": 2, "rid": ["r-1"],
                                                  "extra_key": ["k"], "lora_path": [None]})
    assert listed["id"] == "r-1"
    gen = server.post("/generate", {"text": ["a", "b"], "rid": ["g-1", "g-2"],
                                    "extra_key": ["k1", "k2"], "lora_path": [None, None],
                                    "sampling_params": {"max_new_tokens": 2}})
    assert [g["meta_info"]["id"] for g in gen] == ["g-1", "g-2"]
    one = server.post("/generate", {"text": "a", "rid": ["g-3"], "extra_key": ["k1"],
                                    "sampling_params": {"max_new_tokens": 2}})
    assert one["meta_info"]["id"] == "g-3"
    with server.client() as c:
        r = c.post("/generate", json={"text": ["a", "b"], "rid": ["g-1"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
        r = c.post("/v1/chat/completions", json={**chat, "rid": ["a", "b"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "rid"


def test_token_masks_in_the_sampler() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0, 3.0], [0.0, 5.0, 1.0, 2.0, 3.0],
                           [0.0, 5.0, 1.0, 2.0, 3.0], [0.0, 5.0, 1.0, 2.0, 3.0]])
    params = [SamplingParams(), SamplingParams(allowed_token_ids=[2, 3]),
              SamplingParams(bad_words_ids=[[1], [0, 4]]),
              SamplingParams(bad_words_ids=[[2, 1]])]
    outs = [[], [], [0], [3]]
    res = Sampler().sample(logits, params, outs)
    # Untouched; the best allowed; 1 banned and 4 after 0; [2, 1] does not match ...3.
    assert res.tokens == [1, 3, 3, 1]
    res = Sampler().sample(logits[3:], params[3:], [[2]])
    assert res.tokens == [4]
    assert not SamplingParams().uses_processors
    assert SamplingParams(allowed_token_ids=[1]).uses_processors
