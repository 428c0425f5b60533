"""Messages between the HTTP front end and the scheduler process (ZeroMQ PUSH/PULL, msgpack).

Every message type is one dataclass below. On the wire a message is a msgpack array
`[VERSION, type name, field values in declaration order]`; nested messages (the outputs of a
`BatchOut`) are encoded the same way. Only msgpack's plain types travel: never pickle.

Front end -> scheduler: `GenerateReq`, `AbortReq`, `ControlReq`, `ShutdownReq`.
Scheduler -> front end: `Ready`, `BatchOut` (of `ReqOut`), `ReqError`, `ControlResp`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack

from hicache_client.errors import HiCacheError

VERSION = 1


class ProtocolError(HiCacheError, ValueError):
    """A frame that is not a message of this protocol (or of another version)."""


@dataclass
class GenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]
    extra_key: str | None = None
    # Logprobs asked for: {"top_logprobs_num": k, "logprob_start_len": s} (Engine.add_request's
    # arguments; engine.req_logprobs), or None.
    logprobs: dict[str, int] | None = None
    # The request's cache hints (hicache.admission.CacheHints.as_dict()), or None.
    cache_hints: dict[str, Any] | None = None


@dataclass
class AbortReq:
    rid: str


@dataclass
class ControlReq:
    # cid: the caller's id for the answer; op: flush_cache, stats, get_storage, attach_storage,
    # detach_storage, clear_storage; payload: the op's arguments.
    cid: str
    op: str
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass
class ShutdownReq:
    reason: str = ""


@dataclass
class Ready:
    pid: int
    model_path: str
    model_id: str
    context_length: int
    max_total_tokens: int
    vocab_size: int
    page_size: int
    storage_backend: str | None
    eos_token_ids: list[int]


@dataclass
class ReqOut:
    rid: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Output text released since the previous ReqOut of this request (the scheduler owns
    # detokenization and stop strings: text that may start a stop string is held back).
    text: str = ""
    # Logprobs new since the previous ReqOut (`ReqLogprobs.take()`), or None when not asked.
    logprobs: dict[str, Any] | None = None
    # The prompt's tokens by hit tier / miss cause (hicache.attribution); on the final ReqOut.
    cache_outcomes: dict[str, int] | None = None


@dataclass
class BatchOut:
    outputs: list[ReqOut]
    nested: ClassVar[dict[str, type]] = {"outputs": ReqOut}


@dataclass
class ReqError:
    # status: the HTTP status the front end answers with (400 bad request, 503 overloaded...).
    rid: str
    message: str
    status: int = 400


@dataclass
class ControlResp:
    cid: str
    status: int
    payload: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


MESSAGE_TYPES: tuple[type, ...] = (
    GenerateReq,
    AbortReq,
    ControlReq,
    ShutdownReq,
    Ready,
    ReqOut,
    BatchOut,
    ReqError,
    ControlResp,
)
_BY_NAME: dict[str, type] = {t.__name__: t for t in MESSAGE_TYPES}


def _to_wire(msg: Any) -> list[Any]:
    cls = type(msg)
    if cls.__name__ not in _BY_NAME or _BY_NAME[cls.__name__] is not cls:
        raise ProtocolError(f"not a protocol message: {cls.__name__}")
    nested: dict[str, type] = getattr(cls, "nested", {})
    values = []
    for f in fields(msg):
        v = getattr(msg, f.name)
        if f.name in nested:
            v = [_to_wire(x) for x in v]
        values.append(v)
    return [VERSION, cls.__name__, values]


def _from_wire(obj: Any) -> Any:
    if not (isinstance(obj, list) and len(obj) == 3):
        raise ProtocolError("a message is [version, type, fields]")
    version, name, values = obj
    if version != VERSION:
        raise ProtocolError(f"protocol version {version!r}, expected {VERSION}")
    cls = _BY_NAME.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {name!r}")
    flds = fields(cls)
    if not isinstance(values, list) or len(values) != len(flds):
        raise ProtocolError(f"{name}: expected {len(flds)} fields")
    nested: dict[str, type] = getattr(cls, "nested", {})
    kw: dict[str, Any] = {}
    for f, v in zip(flds, values):
        if f.name in nested:
            if not isinstance(v, list):
                raise ProtocolError(f"{name}.{f.name}: expected a list")
            v = [_from_wire(x) for x in v]
        kw[f.name] = v
    return cls(**kw)


def encode(msg: Any) -> bytes:
    return bytes(msgpack.packb(_to_wire(msg), use_bin_type=True))


def decode(frame: bytes) -> Any:
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise ProtocolError(f"not msgpack: {e}") from e
    return _from_wire(obj)
