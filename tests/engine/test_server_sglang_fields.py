"""SGLang's request schema on a real `hicache-engine` (demo model).

Bodies built by SGLang 0.5.23's own request classes (`CompletionRequest`,
`ChatCompletionRequest`, `GenerateReqInput` with its `SamplingParams`), every field at its
default, are accepted on every route, streamed or not (each row of
`engine.server.request_fields` is checked by test_server_client_fields); and the fields the engine honours do what SGLang does with them (`no_stop_trim`,
`skip_special_tokens`, `ignore_eos`, `continue_final_message`, `max_completion_tokens`, `echo`,
`regex`, `rid`, `sampling_seed`, chat `input_ids`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

import pytest

from engine.demo_model import ensure_demo_model
from tests.engine.test_server_api import EngineServer, engine_server, sse_events
from tests.integrations.sglang_env import load_sglang_pools, sglang_skip_reason

_SKIP = sglang_skip_reason()
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")

# SamplingParams fields SGLang fills in itself (its "internal fields", not API-facing).
SGLANG_INTERNAL = {"stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len",
                   "is_normalized", "ebnf_full_assistant"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    with engine_server(tmp_path_factory.mktemp("sglang-fields")) as srv:
        yield srv


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_demo_model())


def sglang_bodies() -> dict[str, dict[str, Any]]:
    """A body per route as SGLang's classes serialize it: every field they define, at its
    default (what sglang-router forwards, after filling in its own defaults)."""
    load_sglang_pools()
    import msgspec
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    completion = CompletionRequest(prompt="Hello", max_tokens=3)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "Hello"}],
                                 max_completion_tokens=3)
    sp = {k: v for k, v in msgspec.structs.asdict(SamplingParams(max_new_tokens=3)).items()
          if k not in SGLANG_INTERNAL}
    gen = {f.name: getattr(GenerateReqInput(text="Hello"), f.name)
           for f in dataclasses.fields(GenerateReqInput)}
    gen["sampling_params"] = sp
    return {"/v1/completions": completion.model_dump(mode="json", by_alias=True),
            "/v1/chat/completions": chat.model_dump(mode="json", by_alias=True),
            "/generate": gen}


def test_every_sglang_field_at_its_default_is_accepted(server: EngineServer) -> None:
    bodies = sglang_bodies()
    # SGLang's own bodies name (nearly) every field of the table and of the models.
    assert len(bodies["/generate"]) > 60 and len(bodies["/generate"]["sampling_params"]) > 25
    assert len(bodies["/v1/chat/completions"]) > 70
    with server.client() as c:
        for path, body in bodies.items():
            r = c.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
            out = r.json()
            if path == "/generate":
                assert out["meta_info"]["completion_tokens"] >= 1
            else:
                assert out["usage"]["completion_tokens"] >= 1
            with c.stream("POST", path, json={**body, "stream": True}) as s:
                assert s.status_code == 200, (path, s.read())
                events = sse_events(s.iter_lines())
            assert events[-1] == "[DONE]" and len(events) >= 2
            assert all("error" not in e for e in events[:-1]), events


def _gen(server: EngineServer, **sp: Any) -> dict[str, Any]:
    out: dict[str, Any] = server.post("/generate", {
        "text": "The tide table lists", "sampling_params": {
            "max_new_tokens": 16, "temperature": 0, "ignore_eos": True, **sp}})
    return out


def test_no_stop_trim_keeps_the_stop_string_and_the_stop_token(server: EngineServer,
                                                               tok: Any) -> None:
    full = _gen(server)
    ids, text = full["output_ids"], full["text"]
    assert text == tok.decode(ids, skip_special_tokens=True)
    # A stop string: cut before it, or (no_stop_trim) the text through the token completing it.
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text.find(stop)
    trimmed = _gen(server, stop=[stop])
    kept = _gen(server, stop=[stop], no_stop_trim=True)
    assert trimmed["text"] == text[:cut]
    assert kept["output_ids"] == trimmed["output_ids"]
    assert kept["text"] == tok.decode(kept["output_ids"], skip_special_tokens=True)
    assert kept["text"].startswith(text[:cut] + stop)
    # A stop token: its text is not output unless no_stop_trim (the ids hold it either way).
    stop_id = ids[5]
    first = ids.index(stop_id)
    trimmed = _gen(server, stop_token_ids=[stop_id])
    kept = _gen(server, stop_token_ids=[stop_id], no_stop_trim=True)
    assert trimmed["output_ids"] == kept["output_ids"] == ids[:first + 1]
    assert trimmed["text"] == tok.decode(ids[:first])
    assert kept["text"] == tok.decode(ids[:first + 1])
    # The OpenAI routes, streamed and not.
    body = {"prompt": "The tide table lists", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "stop": [stop], "no_stop_trim": True}
    out = server.post("/v1/completions", body)
    assert out["choices"][0]["text"] == _gen(server, stop=[stop], no_stop_trim=True)["text"]
    with server.client() as c, c.stream("POST", "/v1/completions",
                                        json={**body, "stream": True}) as s:
        events = sse_events(s.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == out["choices"][0]["text"]


def test_ignore_eos_and_skip_special_tokens(server: EngineServer, tok: Any) -> None:
    eos = tok.eos_token_id
    force = {"logit_bias": {str(eos): 100}, "max_tokens": 3, "temperature": 0}
    body = {"prompt": "Hello", **force}
    stopped = server.post("/v1/completions", body)["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == ""
    ignored = server.post("/v1/completions", {**body, "ignore_eos": True})
    assert ignored["choices"][0]["finish_reason"] == "length"
    assert ignored["usage"]["completion_tokens"] == 3 and ignored["choices"][0]["text"] == ""
    shown = server.post("/v1/completions", {**body, "ignore_eos": True,
                                            "skip_special_tokens": False})
    assert shown["choices"][0]["text"] == tok.eos_token * 3
    chat = server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hello"}], **force, "ignore_eos": True,
        "skip_special_tokens": False})
    assert chat["choices"][0]["message"]["content"] == tok.eos_token * 3


def test_chat_fields(server: EngineServer, tok: Any) -> None:
    user = {"role": "user", "content": "Which pier floods first?"}
    base = {"temperature": 0, "ignore_eos": True}
    # max_completion_tokens is max_tokens under its newer name; it wins when both are given.
    out = server.post("/v1/chat/completions", {"messages": [user], **base, "max_tokens": 6,
                                               "max_completion_tokens": 2})
    assert out["usage"]["completion_tokens"] == 2
    # continue_final_message: the template over the messages before the assistant's, then its
    # text (SGLang's prompt), continued.
    prefix = "The first pier to flood is"
    cont = server.post("/v1/chat/completions", {
        "messages": [user, {"role": "assistant", "content": prefix}], **base, "max_tokens": 5,
        "continue_final_message": True})
    want = tok.apply_chat_template([user], add_generation_prompt=True, tokenize=False)
    ids = tok(want, add_special_tokens=False)["input_ids"] + tok(prefix)["input_ids"]
    if tok.bos_token_id is not None and ids.count(tok.bos_token_id) > 1:
        ids.remove(tok.bos_token_id)
    ref = server.post("/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}})
    assert cont["usage"]["prompt_tokens"] == len(ids)
    assert cont["choices"][0]["message"]["content"] == ref["text"]
    closed = server.post("/v1/chat/completions", {
        "messages": [user, {"role": "assistant", "content": prefix}], **base, "max_tokens": 5})
    assert closed["usage"]["prompt_tokens"] != len(ids)
    # input_ids: the prompt as given, no template.
    by_ids = server.post("/v1/chat/completions", {"messages": [user], "input_ids": ids,
                                                  **base, "max_tokens": 5})
    assert by_ids["choices"][0]["message"]["content"] == ref["text"]
    # rid names the response; a message's name reaches the template.
    named = server.post("/v1/chat/completions", {
        "messages": [{**user, "name": "ann"}], **base, "max_tokens": 2, "rid": "req-42"})
    assert named["id"] == "req-42"


def test_completion_and_generate_fields(server: EngineServer, tok: Any) -> None:
    echo = server.post("/v1/completions", {"prompt": "Hello there", "max_tokens": 3,
                                           "temperature": 0, "ignore_eos": True, "echo": True})
    plain = server.post("/v1/completions", {"prompt": "Hello there", "max_tokens": 3,
                                            "temperature": 0, "ignore_eos": True})
    assert echo["choices"][0]["text"] == tok.decode(tok("Hello there")["input_ids"],
                                                    skip_special_tokens=True) + \
        plain["choices"][0]["text"]
    # SGLang's structured output on the OpenAI routes.
    rx = server.post("/v1/completions", {"prompt": "Number:", "max_tokens": 8, "temperature": 0,
                                         "regex": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", rx["choices"][0]["text"]), rx
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "x", "regex": "a",
                                            "response_format": {"type": "json_object"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
        r = c.post("/generate", json={"text": "x", "sampling_params": {
            "seed": 1, "sampling_seed": 2}})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "sampling_params.sampling_seed"
    # sampling_seed is seed under SGLang's name.
    a = _gen(server, temperature=1.0, seed=7)
    b = _gen(server, temperature=1.0, sampling_seed=7)
    assert a["output_ids"] == b["output_ids"]
