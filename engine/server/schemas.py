"""Request bodies of the HTTP API and their decoding: errors, strict models, the fields of
other engines' APIs.

Bodies are strict: a wrong type is a 400, not a coercion, and a field the server does not know
is a 400 naming it (`--allow-unknown-fields` drops unknown fields instead). The request schema
of SGLang's server (its OpenAI routes, `/generate` and its `sampling_params`) is accepted: the
fields the engine honours are declared in the models below, and every other field SGLang, vLLM
or OpenAI define is a row of `engine.server.request_fields`: taken when its value asks nothing
of this engine (its default, mostly), refused with a 400 naming it otherwise, whatever
`--allow-unknown-fields` says: a client never gets output that silently ignored what it asked.
Every error is an OpenAI-style body `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import pydantic_core
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.server import request_fields as RF
from hicache.admission import CacheHints

# Bodies this size or smaller are parsed a second time (by the stdlib) after a JSON error, to
# name the field that holds a lone surrogate.
_DIAGNOSE_BYTES = 1 << 20
_SURROGATE = re.compile("[\ud800-\udfff]")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 fields: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        # The request's fields that were refused: name -> "unsupported" (a row of
        # engine.server.request_fields at a value it does not take) or "unknown".
        self.fields = fields or {}

    def with_fields(self, fields: dict[str, str]) -> ApiError:
        self.fields = fields
        return self

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


# ---- the models -------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    # vLLM's clients send null for either (its defaults are Optional).
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # with include_usage: the usage in every chunk


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` (its StructuredOutputsParams): one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: str  # text, json_object, json_schema
    json_schema: JsonSchemaFormat | None = None


class _OpenAISampling(_Body):
    """The fields completions and chat share (OpenAI's and SGLang's extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False  # keep the matched stop string / stop token's text
    include_stop_str_in_output: bool = False  # vLLM's no_stop_trim
    # The client's name of the request: the response's id (SGLang's list form: one element).
    rid: str | list[str] | None = None
    request_id: str | None = None  # vLLM's: the response's id is cmpl- / chatcmpl- and this
    # Cache isolation (a tenant salt): requests with different salts never share pages.
    # SGLang's extra_key does the same; both given, the pair is the namespace.
    cache_salt: str | None = None
    extra_key: str | list[str] | None = None
    # The request's cache hints (hicache.admission.CacheHints; docs/retention.md).
    skip_cache_write: bool | None = None
    retention_seconds: float | None = None
    priority: int | None = None
    # usage.prompt_tokens_details.cache_outcomes: the prompt's tokens by hit tier / miss cause.
    return_cached_tokens_details: bool = False
    # Sampling beyond the basics (engine.server.openai_params maps them).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    response_format: ResponseFormat | None = None
    # SGLang's structured output (at most one; or response_format, or vLLM's).
    regex: str | None = None
    ebnf: str | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's prompt and logprob options.
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool | None = None


class CompletionBody(_OpenAISampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None  # top alternatives per token (0: the chosen token's only)
    json_schema: str | None = None
    add_special_tokens: bool = True  # BOS in front of a text prompt


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None  # given to the chat template


class ChatBody(_OpenAISampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # max_tokens under its newer name (it wins)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # The last message, an assistant's, is continued: the template's generation prompt, then
    # its text (SGLang's way).
    continue_final_message: bool = False
    echo: bool = False  # vLLM's: the last message's text first, when it has the answer's role
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # special tokens added when the templated text is tokenized
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables of the template
    input_ids: list[int] | None = None  # the prompt already tokenized (no template)


class GenerateSampling(_Body):
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    sampling_seed: int | None = None  # SGLang's name of `seed`
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: int = 1  # parallel sampling: n outputs of each prompt that share its pages
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    min_new_tokens: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


class GenerateBody(_Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSampling | None = None
    stream: bool = False
    # The client's name for the request (echoed as meta_info.id); a list: one per prompt.
    rid: str | list[str] | None = None
    extra_key: str | list[str] | None = None  # a list: one per prompt
    cache_salt: str | None = None  # as extra_key (both given: the pair)
    # The request's cache hints (hicache.admission.CacheHints; docs/retention.md).
    skip_cache_write: bool | None = None
    retention_seconds: float | None = None
    priority: int | None = None
    return_logprob: bool | None = None
    top_logprobs_num: int | None = None
    logprob_start_len: int | None = None
    return_text_in_logprobs: bool = False
    # Routing information a gateway (smg, sglang-router) adds to the body; one model is served,
    # so it is accepted and not otherwise used.
    model: str | None = None


class StorageBody(_Body):
    backend: str
    extra_config: dict[str, Any] | None = None


def cache_hints(body: CompletionBody | ChatBody | GenerateBody) -> dict[str, Any] | None:
    """The body's cache hints as they travel to the scheduler (None: none asked); a value out
    of range is a 400 naming its field (a wrong type already was, by the model)."""
    fields = {"skip_cache_write": body.skip_cache_write,
              "retention_seconds": body.retention_seconds, "priority": body.priority}
    try:
        hints = CacheHints.from_any(fields)
    except ValueError as e:
        raise bad(str(e), "retention_seconds") from e
    return hints.as_dict() or None


# ---- other APIs' fields (engine.server.request_fields) ------------------------------------------


def cache_key(extra_key: str | None, cache_salt: str | None) -> str | None:
    """The cache namespace of a request that names `extra_key` and / or `cache_salt`."""
    if extra_key is None or cache_salt is None:
        return extra_key if cache_salt is None else cache_salt
    return json.dumps([extra_key, cache_salt])


_SCOPE: dict[type[BaseModel], str] = {
    CompletionBody: RF.COMPLETION, ChatBody: RF.CHAT, GenerateBody: RF.GENERATE,
}


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _take(data: dict[str, Any], table: Mapping[str, RF.Row], refused: dict[str, str],
          prefix: str = "") -> None:
    """Note in `refused` each default-only field of `table` with a value its row does not take
    (name -> why); drop the others (the models do not declare them). Honoured rows stay."""
    for name in [n for n in data if n in table and not table[n].honoured]:
        value = data[name]
        row = table[name]
        if not row.takes(value):
            refused[prefix + name] = (f"{prefix}{name}={_shown(value)} asks for {row.asks}, "
                                      "which this engine does not do")
        del data[name]


_NESTED: dict[str, tuple[tuple[str, str], ...]] = {
    RF.GENERATE: (("sampling_params", RF.SAMPLING),),
    RF.COMPLETION: (("stream_options", RF.STREAM_OPTIONS),
                    ("structured_outputs", RF.STRUCTURED)),
    RF.CHAT: (("stream_options", RF.STREAM_OPTIONS), ("structured_outputs", RF.STRUCTURED)),
}


def _take_fields(data: dict[str, Any], scope: str) -> dict[str, str]:
    refused: dict[str, str] = {}
    _take(data, RF.TABLES[scope], refused)
    for key, where in _NESTED[scope]:
        if isinstance(data.get(key), dict):
            _take(data[key], RF.TABLES[where], refused, key + ".")
    if scope == RF.CHAT and isinstance(data.get("messages"), list):
        for i, msg in enumerate(data["messages"]):
            if isinstance(msg, dict):
                _take(msg, RF.TABLES[RF.MESSAGE], refused, f"messages.{i}.")
    return refused


def _refusal(refused: dict[str, str], unknown: list[str]) -> ApiError:
    """One 400 that names every refused field: those asking for what the engine does not do
    (`unsupported_parameter`, whatever --allow-unknown-fields says) and the unknown ones."""
    parts = [*refused.values()]
    if unknown:
        parts.append(f"{', '.join(unknown)}: unknown field{'s' if len(unknown) > 1 else ''} "
                     "(start the server with --allow-unknown-fields to ignore unknown fields)")
    names = [*refused, *unknown]
    if refused:
        msg = ("not supported by this server (the request would get less than it asked for, "
               "so it is refused): " + "; ".join(parts))
    else:
        msg = parts[0]
    fields = {**{n: "unsupported" for n in refused}, **{n: "unknown" for n in unknown}}
    return bad(msg, ", ".join(names), code="unsupported_parameter" if refused
               else "unknown_field").with_fields(fields)


# ---- decoding -------------------------------------------------------------------------------


def _surrogate_path(obj: Any, path: str = "") -> str | None:
    """The path of the first string (key or value) that holds a lone UTF-16 surrogate."""
    if isinstance(obj, str):
        return path or "(body)" if _SURROGATE.search(obj) else None
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            found = _surrogate_path(v, f"{path}.{i}" if path else str(i))
            if found:
                return found
    if isinstance(obj, dict):
        for k, v in obj.items():
            if _SURROGATE.search(k):  # named with escapes: the error body must be valid text
                return f"{path}.{ascii(k)}" if path else ascii(k)
            found = _surrogate_path(v, f"{path}.{k}" if path else k)
            if found:
                return found
    return None


def load_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object. Strict JSON (no NaN / Infinity, valid Unicode: a lone surrogate
    such as `"\\ud800"` is refused, naming its field). The parser releases the GIL, so a large
    body parsed on a worker thread does not stall the event loop."""
    try:
        data = pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as e:
        msg = f"the body is not valid JSON: {e}"
        if len(raw) <= _DIAGNOSE_BYTES:
            try:
                where = _surrogate_path(json.loads(raw))
            except (ValueError, RecursionError):
                where = None
            if where:
                raise bad(f"{where}: a lone UTF-16 surrogate (\\ud800-\\udfff) is not valid "
                          "Unicode text", where, code="invalid_string") from e
        raise bad(msg, code="invalid_json") from e
    if not isinstance(data, dict):
        raise bad("the body must be a JSON object", code="invalid_json")
    return data


def validate(data: dict[str, Any], model: type[Any], allow_unknown: bool = False) -> Any:
    """`data` as `model`, strictly; other APIs' fields taken or refused, unknown ones refused
    (or dropped with `allow_unknown`). One 400 names every refused and unknown field."""
    scope = _SCOPE.get(model)
    refused = _take_fields(data, scope) if scope is not None else {}
    unknown: list[str] = []
    for _ in range(8):  # each retry drops the unknown fields pydantic reported
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            errors = e.errors()
            extra = [err for err in errors if err.get("type") == "extra_forbidden"]
            for err in extra:
                _drop(data, err.get("loc", ()))
                if not allow_unknown:
                    unknown.append(".".join(str(x) for x in err.get("loc", ())))
            if extra and len(extra) == len(errors):
                continue  # again without them
            if refused or unknown:
                raise _refusal(refused, unknown) from e
            err = next(x for x in errors if x.get("type") != "extra_forbidden")
            param = ".".join(str(x) for x in err.get("loc", ())) or None
            msg = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
            raise bad(msg, param) from e
        if refused or unknown:
            raise _refusal(refused, unknown)
        return body
    raise bad("too many unknown fields")


def _drop(data: Any, loc: tuple[Any, ...]) -> None:
    for key in loc[:-1]:  # keys that are neither (union member tags) are skipped
        in_dict = isinstance(data, dict) and key in data
        if in_dict or isinstance(data, list) and isinstance(key, int) and 0 <= key < len(data):
            data = data[key]
    if isinstance(data, dict) and loc:
        data.pop(loc[-1], None)
