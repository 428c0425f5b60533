"""Request bodies -> the engine's sampling parameters and logprob requests, for the fields of
issue 17: penalties, `min_p`, `logit_bias`, `min_tokens`, structured output and logprobs.

* `response_format`: `json_object` is the schema `{"type": "object"}`, `json_schema` its
  `json_schema.schema`, `text` nothing (engine.grammar compiles them; a schema that does not
  compile is a 400 from the scheduler's admission).
* SGLang's own: `json_schema` / `regex` / `ebnf` (completions; chat `regex` / `ebnf`; in
  `sampling_params`), `no_stop_trim`, `sampling_seed` (`seed`).
* vLLM's: `structured_outputs` (`json`, `regex`, `choice` (a grammar of the alternatives),
  `grammar` (EBNF), `json_object`) and its older `guided_*` names; `include_stop_str_in_output`
  (`no_stop_trim`), `allowed_token_ids`, `prompt_logprobs` (the prompt's from token 0, the top
  k shared with `logprobs`: the larger is computed, each shown to its own k).
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


def _ebnf_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _structured(body: CompletionBody | ChatBody) -> tuple[str, dict[str, Any]] | None:
    """vLLM's `structured_outputs` or one of its older `guided_*` fields: (the field, the
    engine's grammar parameter), None when none is given."""
    given: list[tuple[str, str, Any]] = []
    so = body.structured_outputs
    if so is not None:
        for attr, kind in (("json_", "json"), ("regex", "regex"), ("choice", "choice"),
                           ("grammar", "grammar")):
            if getattr(so, attr) is not None:
                given.append((f"structured_outputs.{kind}", kind, getattr(so, attr)))
        if so.json_object:
            given.append(("structured_outputs.json_object", "json_object", True))
        if not given:
            raise bad("structured_outputs needs one of json, regex, choice, grammar, "
                      "json_object", "structured_outputs")
    for kind in ("json", "regex", "choice", "grammar"):
        v = getattr(body, f"guided_{kind}")
        if v is not None:
            given.append((f"guided_{kind}", kind, v))
    if not given:
        return None
    if len(given) > 1:
        raise bad("give one structured-output constraint, got "
                  + ", ".join(p for p, _, _ in given), given[1][0])
    param, kind, v = given[0]
    if kind == "json":
        return param, {"json_schema": v if isinstance(v, str) else json.dumps(v)}
    if kind == "json_object":
        return param, {"json_schema": '{"type": "object"}'}
    if kind == "regex":
        return param, {"regex": v}
    if kind == "grammar":
        return param, {"ebnf": v}
    if not v or not all(v):
        raise bad(f"{param} must list non-empty strings", param)
    return param, {"ebnf": "root ::= " + " | ".join(_ebnf_string(c) for c in v)}


def openai_sampling(body: CompletionBody | ChatBody) -> dict[str, Any]:
    """The sampling parameters of an OpenAI body beyond those `ServerState.sampling` reads
    (vLLM's `bad_words` need the tokenizer: the route adds them)."""
    out = _common(body)
    if body.min_tokens is not None:
        out["min_tokens"] = body.min_tokens
    if body.no_stop_trim or body.include_stop_str_in_output:
        out["no_stop_trim"] = True
    if body.allowed_token_ids is not None:
        if not body.allowed_token_ids:
            raise bad("allowed_token_ids must not be empty", "allowed_token_ids")
        out["allowed_token_ids"] = list(body.allowed_token_ids)
    out.update(_grammar(body))
    st = _structured(body)
    for param, extra in (("response_format", _response_format(body.response_format)),
                         *([st] if st else [])):
        if extra and out.keys() & {"json_schema", "regex", "ebnf"}:
            raise bad("give one of response_format, structured_outputs, json_schema, regex, "
                      "ebnf, not several", param)
        out.update(extra)
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


def _with_prompt(spec: LogprobSpec | None, body: CompletionBody | ChatBody) -> \
        LogprobSpec | None:
    """`spec` extended by vLLM's `prompt_logprobs` (the prompt's from token 0)."""
    if body.prompt_logprobs is None:
        return spec
    k = _top(body.prompt_logprobs, "prompt_logprobs")
    top = k if spec is None else max(k, spec["top_logprobs_num"])
    return {"top_logprobs_num": top, "logprob_start_len": 0}


def completion_logprobs(body: CompletionBody) -> LogprobSpec | None:
    spec = None if body.logprobs is None else {
        "top_logprobs_num": _top(body.logprobs, "logprobs"),
        "logprob_start_len": 0 if body.echo else -1}
    return _with_prompt(spec, body)


def chat_logprobs(body: ChatBody) -> LogprobSpec | None:
    if not body.logprobs:
        if body.top_logprobs:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        return _with_prompt(None, body)
    return _with_prompt({"top_logprobs_num": _top(body.top_logprobs or 0, "top_logprobs"),
                         "logprob_start_len": -1}, body)


def generate_logprobs(body: GenerateBody) -> LogprobSpec | None:
    if not body.return_logprob:
        return None
    start = -1 if body.logprob_start_len is None else body.logprob_start_len
    if start < -1:
        raise bad("logprob_start_len must be -1 or >= 0", "logprob_start_len")
    return {"top_logprobs_num": _top(body.top_logprobs_num or 0, "top_logprobs_num"),
            "logprob_start_len": start}
