"""The front end's request semantics on a real `hicache-engine` (demo model): `n` > 1 computes
the prompt once and shares its pages (hit tokens prove it), streamed choices carry their index,
usage counts the prompt once; strict bodies (unknown fields and fields the engine cannot honour
are a 400 naming them; neutral values pass; `--allow-unknown-fields` drops only the unknown);
`/get_server_info` and `/v1/models/{id}`."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.engine.test_server_api import EngineServer, engine_server, sse_events

PS = 32  # the default page size


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    with engine_server(tmp_path_factory.mktemp("server-openai")) as srv:
        yield srv


def fresh_prompt(seed: int, n_tokens: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(5, 1000) for _ in range(n_tokens)]


def test_n_samples_compute_the_prompt_once(server: EngineServer) -> None:
    prompt = fresh_prompt(1, 4 * PS + 1)  # four full pages and one token
    server.post("/flush_cache", {})
    before = server.stats()
    out = server.post("/v1/completions", {"prompt": prompt, "n": 4, "max_tokens": 3,
                                          "temperature": 1.0, "seed": 11, "ignore_eos": True})
    after = server.stats()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    assert out["usage"] == {"prompt_tokens": 4 * PS + 1, "completion_tokens": 12,
                            "total_tokens": 4 * PS + 13,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    # One request computed the prompt (no hit); each of the four samples found its four full
    # pages on the device.
    assert after["requests"] - before["requests"] == 5
    assert after["device_hit_tokens"] - before["device_hit_tokens"] == 4 * 4 * PS
    assert after["device_hit_requests"] - before["device_hit_requests"] == 4
    # Sample j used seed 11 + j: the same request gives the same choices.
    again = server.post("/v1/completions", {"prompt": prompt, "n": 4, "max_tokens": 3,
                                            "temperature": 1.0, "seed": 11, "ignore_eos": True})
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in out["choices"]]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * PS
    single = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 3,
                                             "temperature": 1.0, "seed": 12, "ignore_eos": True})
    assert single["choices"][0]["text"] == out["choices"][1]["text"]


def test_n_samples_stream_with_their_index(server: EngineServer) -> None:
    body = {"prompt": fresh_prompt(2, 40), "n": 3, "max_tokens": 5, "temperature": 1.0,
            "seed": 3, "ignore_eos": True}
    whole = server.post("/v1/completions", body)
    with server.client() as c, c.stream("POST", "/v1/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for e in events[:-2]:
        (ch,) = e["choices"]
        texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
        if ch["finish_reason"]:
            finish[ch["index"]] = ch["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert events[-2]["usage"]["prompt_tokens"] == 40
    assert events[-2]["usage"]["completion_tokens"] == 15
    # Chat and SGLang's parallel sampling (sampling_params.n).
    chat = server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Name a colour."}], "n": 2, "max_tokens": 4,
        "temperature": 1.0, "seed": 5})
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    gen = server.post("/generate", {"input_ids": fresh_prompt(3, 40), "sampling_params": {
        "n": 2, "max_new_tokens": 4, "temperature": 1.0, "seed": 5, "ignore_eos": True}})
    assert isinstance(gen, list) and [g["index"] for g in gen] == [0, 1]
    assert all(len(g["output_ids"]) == 4 for g in gen)


UNSUPPORTED: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"stop_regex": "[a-z]+"}, "stop_regex"),
    ("/v1/chat/completions", {"store": True}, "store"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/generate", {"token_ids_logprob": [1, 2]}, "token_ids_logprob"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2, "stop_regex": "a"}},
     "sampling_params.stop_regex"),
]
UNKNOWN: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/completions", {"no_such_field": 1}, "no_such_field"),
    ("/v1/completions", {"stream_options": {"include_usage": True, "extra": 1}},
     "stream_options.extra"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "nick": "bob"}]},
     "messages.0.nick"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2, "no_such_param": 1}},
     "sampling_params.no_such_param"),
    ("/generate", {"lora_name": "x"}, "lora_name"),
]
NEUTRAL: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"logprobs": None, "presence_penalty": 0, "frequency_penalty": 0.0,
                         "logit_bias": {}, "best_of": 1}),
    ("/v1/chat/completions", {"logprobs": False, "response_format": {"type": "text"},
                              "tools": [], "tool_choice": "none"}),
    ("/generate", {"return_logprob": False,
                   "sampling_params": {"max_new_tokens": 2, "repetition_penalty": 1.0}}),
]


def base(path: str) -> dict[str, Any]:
    if path == "/v1/completions":
        return {"prompt": "hi", "max_tokens": 2}
    if path == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return {"text": "hi", "sampling_params": {"max_new_tokens": 2}}


def check_refusals(server: EngineServer, unknown_refused: bool) -> None:
    with server.client() as c:
        for path, extra, param in UNSUPPORTED:
            r = c.post(path, json={**base(path), **extra})
            assert r.status_code == 400, (path, extra, r.text)
            err = r.json()["error"]
            assert (err["param"], err["code"]) == (param, "unsupported_parameter"), err
            assert param in err["message"]
        for path, extra, param in UNKNOWN:
            r = c.post(path, json={**base(path), **extra})
            if not unknown_refused:
                assert r.status_code == 200, (path, extra, r.text)
                continue
            assert r.status_code == 400, (path, extra, r.text)
            err = r.json()["error"]
            assert (err["param"], err["code"]) == (param, "unknown_field"), err
            assert "--allow-unknown-fields" in err["message"]
        for path, extra in NEUTRAL:
            r = c.post(path, json={**base(path), **extra})
            assert r.status_code == 200, (path, extra, r.text)


def test_unknown_and_unsupported_fields_are_refused(server: EngineServer) -> None:
    check_refusals(server, unknown_refused=True)


def test_allow_unknown_fields_drops_only_unknown_ones(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    with engine_server(tmp_path_factory.mktemp("lenient"), ["--allow-unknown-fields"],
                       name="lenient") as srv:
        check_refusals(srv, unknown_refused=False)


def test_server_info_and_model_card(server: EngineServer) -> None:
    info = server.get("/get_server_info")
    assert info["port"] == server.port and info["page_size"] == PS
    assert info["max_total_tokens"] == 16384 == info["max_total_num_tokens"]
    assert info["context_length"] == 4096 and info["served_model_name"] == "hicache-demo"
    assert info["allow_unknown_fields"] is False and info["api_key"] is None
    assert info["internal_states"][0]["scheduler"]["running"] == 0
    assert isinstance(info["version"], str) and info["version"]
    card = server.get("/v1/models/hicache-demo")
    assert card == server.get("/v1/models")["data"][0]
    assert card["id"] == "hicache-demo" and card["max_model_len"] == 4096
    with server.client() as c:
        r = c.get("/v1/models/other")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_openai_client_n_and_refusals(server: EngineServer) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    resp = client.completions.create(model="hicache-demo", prompt="The lighthouse", n=3,
                                     max_tokens=3, temperature=1.0, seed=4,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert resp.usage is not None and resp.usage.completion_tokens == 9
    messages = [{"role": "user", "content": "Name a colour."}]
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(
            model="hicache-demo", messages=messages, n=2, max_tokens=4,  # type: ignore[arg-type]
            temperature=1.0, seed=4, stream=True):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    whole = client.chat.completions.create(model="hicache-demo", messages=messages, n=2,  # type: ignore[arg-type]
                                           max_tokens=4, temperature=1.0, seed=4)
    assert texts == {c.index: c.message.content for c in whole.choices}
    for kw in ({"tools": [{"type": "function", "function": {"name": "f"}}]},
               {"tool_choice": "required"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="hicache-demo", messages=messages,  # type: ignore[arg-type]
                                           max_tokens=2, **kw)  # type: ignore[arg-type]
        assert next(iter(kw)) in str(e.value)
