"""Request bodies of the HTTP API and their decoding: errors, strict models, unsupported fields.

Bodies are strict: a wrong type is a 400, not a coercion, and a field the server does not know
is a 400 naming it (`--allow-unknown-fields` drops unknown fields instead). Fields of the OpenAI
and SGLang APIs that the engine cannot honour yet (logprobs, penalties, structured output,
tools, ...) are refused with a 400 naming them unless they carry their neutral value, whatever
`--allow-unknown-fields` says: a client never gets output that silently ignored what it asked.
Every error is an OpenAI-style body `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import pydantic_core
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

# Bodies this size or smaller are parsed a second time (by the stdlib) after a JSON error, to
# name the field that holds a lone surrogate.
_DIAGNOSE_BYTES = 1 << 20
_SURROGATE = re.compile("[\ud800-\udfff]")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

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
    include_usage: bool = False


class _OpenAISampling(_Body):
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
    user: str | None = None
    # Cache isolation (a tenant salt): requests with different salts never share pages.
    cache_salt: str | None = None


class CompletionBody(_OpenAISampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None


class ChatBody(_OpenAISampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class GenerateSampling(_Body):
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    n: int = 1  # parallel sampling: n outputs of each prompt that share its pages


class GenerateBody(_Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSampling | None = None
    stream: bool = False
    rid: str | None = None  # the client's name for the request (echoed as meta_info.id)
    extra_key: str | None = None
    # Routing information a gateway (smg, sglang-router) adds to the body; one model is served,
    # so it is accepted and not otherwise used.
    model: str | None = None


class StorageBody(_Body):
    backend: str
    extra_config: dict[str, Any] | None = None


# ---- fields refused unless neutral --------------------------------------------------------------


def _none_or(*neutral: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == x and type(v) is type(x) for x in neutral)


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {}


_PENALTIES: dict[str, Callable[[Any], bool]] = {
    "frequency_penalty": _none_or(0, 0.0), "presence_penalty": _none_or(0, 0.0),
    "repetition_penalty": _none_or(1, 1.0), "min_p": _none_or(0, 0.0),
    "logit_bias": _empty, "min_tokens": _none_or(0),
}
_OPENAI_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    **_PENALTIES, "logprobs": _none_or(False), "top_logprobs": _none_or(0),
    "response_format": lambda v: v is None or v == {"type": "text"}, "tools": _empty,
    "tool_choice": _none_or("none"), "functions": _empty, "function_call": _none_or("none"),
    "parallel_tool_calls": _none_or(False, True), "best_of": _none_or(1), "suffix": _none_or(""),
    "regex": _none_or(), "ebnf": _none_or(), "json_schema": _none_or(),
    "guided_json": _none_or(), "guided_regex": _none_or(), "guided_grammar": _none_or(),
    "guided_choice": _none_or(),
}
_SAMPLING_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    **_PENALTIES, "min_new_tokens": _none_or(0), "regex": _none_or(), "ebnf": _none_or(),
    "json_schema": _none_or(), "structural_tag": _none_or(), "stop_regex": _none_or(),
}
_GENERATE_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "return_logprob": _none_or(False), "logprob_start_len": _none_or(-1),
    "top_logprobs_num": _none_or(0), "token_ids_logprob": _none_or(),
    "return_text_in_logprobs": _none_or(False), "image_data": _empty, "audio_data": _empty,
    "video_data": _empty, "lora_path": _none_or(), "return_hidden_states": _none_or(False),
    "custom_logit_processor": _none_or(), "session_params": _none_or(),
    # Fields the smg gateway sends with every forwarded request, at these values.
    "log_metrics": _none_or(True), "no_logs": _none_or(False), "background": _none_or(False),
    "return_bytes": _none_or(False), "return_entropy": _none_or(False),
}
UNSUPPORTED: dict[type[BaseModel], dict[str, Callable[[Any], bool]]] = {
    CompletionBody: _OPENAI_UNSUPPORTED, ChatBody: _OPENAI_UNSUPPORTED,
    GenerateBody: _GENERATE_UNSUPPORTED,
}


def _refuse_unsupported(data: dict[str, Any], table: Mapping[str, Callable[[Any], bool]],
                        prefix: str = "") -> None:
    """Raise for a field of `table` with a value other than its neutral one; drop the neutral
    ones (the models do not declare them)."""
    for name, neutral in table.items():
        if name not in data:
            continue
        if not neutral(data[name]):
            raise bad(f"{prefix}{name} is not supported by this server (it would be ignored, so "
                      "the request is refused)", prefix + name, code="unsupported_parameter")
        del data[name]


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
    """`data` as `model`, strictly; unsupported fields refused, unknown ones refused (or dropped
    with `allow_unknown`)."""
    table = UNSUPPORTED.get(model)
    if table is not None:
        _refuse_unsupported(data, table)
    sp = data.get("sampling_params")
    if model is GenerateBody and isinstance(sp, dict):
        _refuse_unsupported(sp, _SAMPLING_UNSUPPORTED, "sampling_params.")
    for _ in range(8):  # each retry drops the unknown fields pydantic reported
        try:
            return model.model_validate(data)
        except ValidationError as e:
            errors = e.errors()
            extra = [err for err in errors if err.get("type") == "extra_forbidden"]
            if allow_unknown and extra and len(extra) == len(errors):
                for err in extra:
                    _drop(data, err.get("loc", ()))
                continue
            err = (extra or errors)[0]
            param = ".".join(str(x) for x in err.get("loc", ())) or None
            if err.get("type") == "extra_forbidden":
                raise bad(f"{param}: unknown field (start the server with "
                          "--allow-unknown-fields to ignore unknown fields)", param,
                          code="unknown_field") from e
            msg = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
            raise bad(msg, param) from e
    raise bad("too many unknown fields")


def _drop(data: Any, loc: tuple[Any, ...]) -> None:
    for key in loc[:-1]:  # keys that are neither (union member tags) are skipped
        in_dict = isinstance(data, dict) and key in data
        if in_dict or isinstance(data, list) and isinstance(key, int) and 0 <= key < len(data):
            data = data[key]
    if isinstance(data, dict) and loc:
        data.pop(loc[-1], None)
