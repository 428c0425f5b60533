"""Request bodies -> the engine's sampling parameters and logprob requests, for the fields of
issue 17: penalties, `min_p`, `logit_bias`, `min_tokens`, structured output and logprobs.

* `response_format`: `json_object` is the schema `{"type": "object"}`, `json_schema` its
  `json_schema.schema`, `text` nothing (engine.grammar compiles them; a schema that does not
  compile is a 400 from the scheduler's admission).
* SGLang's own: `json_schema` / `regex` / `ebnf` (completions; chat `regex` / `ebnf`; in
  `sampling_params`), `no_stop_trim`, `sampling_seed` (`seed`).
* Logprobs, as `GenerateReq.logprobs` (`{"top_logprobs_num", "logprob_start_len"}`):
  completions `logprobs: k` (`echo` adds the prompt's, from token 0), chat `logprobs: true` with
  `top_logprobs: k`, SGLang's `return_logprob` / `top_logprobs_num` / `logprob_start_len`.
"""

from __future__ import annotations

import json
from typing import Any

from engine.req_logprobs import MAX_TOP_LOGPROBS
from engine.server.schemas import (
    ChatBody,
    CompletionBody,
    GenerateBody,
    GenerateSampling,
    ResponseFormat,
    bad,
)

LogprobSpec = dict[str, int]


def _common(body: CompletionBody | ChatBody | GenerateSampling) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p",
                 "logit_bias"):
        v = getattr(body, name)
        if v is not None:
            out[name] = v
    return out


def _response_format(rf: ResponseFormat | None) -> dict[str, Any]:
    if rf is None or rf.type == "text":
        return {}
    if rf.type == "json_object":
        return {"json_schema": '{"type": "object"}'}
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad("response_format json_schema needs json_schema.schema",
                      "response_format.json_schema")
        return {"json_schema": json.dumps(rf.json_schema.schema_)}
    raise bad(f"response_format.type must be text, json_object or json_schema, got "
              f"{rf.type!r}", "response_format.type")


def _grammar(body: CompletionBody | ChatBody | GenerateSampling) -> dict[str, Any]:
    """SGLang's `json_schema` / `regex` / `ebnf` (SamplingParams refuses more than one)."""
    out = {}
    for kind in ("json_schema", "regex", "ebnf"):
        v = getattr(body, kind, None)
        if v is not None:
            out[kind] = v
    return out


def openai_sampling(body: CompletionBody | ChatBody) -> dict[str, Any]:
    """The sampling parameters of an OpenAI body beyond those `ServerState.sampling` reads."""
    out = _common(body)
    if body.min_tokens is not None:
        out["min_tokens"] = body.min_tokens
    if body.no_stop_trim:
        out["no_stop_trim"] = True
    out.update(_grammar(body))
    rf = _response_format(body.response_format)
    if rf and out.keys() & {"json_schema", "regex", "ebnf"}:
        raise bad("give response_format or one of json_schema, regex, ebnf, not both",
                  "response_format")
    out.update(rf)
    return out


def generate_sampling(sp: GenerateSampling) -> dict[str, Any]:
    """The same for SGLang's `sampling_params` (`min_new_tokens`, `json_schema`, `regex`,
    `ebnf`, `no_stop_trim`)."""
    out = _common(sp)
    if sp.min_new_tokens is not None:
        out["min_tokens"] = sp.min_new_tokens
    if sp.no_stop_trim:
        out["no_stop_trim"] = True
    out.update(_grammar(sp))
    return out


def generate_seed(sp: GenerateSampling) -> int | None:
    """`seed`, or SGLang's name of it, `sampling_seed`."""
    if sp.seed is not None and sp.sampling_seed is not None and sp.seed != sp.sampling_seed:
        raise bad("seed and sampling_seed differ (they are one setting)",
                  "sampling_params.sampling_seed")
    return sp.seed if sp.seed is not None else sp.sampling_seed


def _top(k: int, param: str) -> int:
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise bad(f"{param} must be in 0..{MAX_TOP_LOGPROBS}, got {k}", param)
    return k


def completion_logprobs(body: CompletionBody) -> LogprobSpec | None:
    if body.logprobs is None:
        return None
    return {"top_logprobs_num": _top(body.logprobs, "logprobs"),
            "logprob_start_len": 0 if body.echo else -1}


def chat_logprobs(body: ChatBody) -> LogprobSpec | None:
    if not body.logprobs:
        if body.top_logprobs:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return {"top_logprobs_num": _top(body.top_logprobs or 0, "top_logprobs"),
            "logprob_start_len": -1}


def generate_logprobs(body: GenerateBody) -> LogprobSpec | None:
    if not body.return_logprob:
        return None
    start = -1 if body.logprob_start_len is None else body.logprob_start_len
    if start < -1:
        raise bad("logprob_start_len must be -1 or >= 0", "logprob_start_len")
    return {"top_logprobs_num": _top(body.top_logprobs_num or 0, "top_logprobs_num"),
            "logprob_start_len": start}
