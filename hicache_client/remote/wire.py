"""How `hicache-server` messages travel: a dataclass <-> ZeroMQ multipart codec and its errors.

`protocol.py` declares which messages exist; this module turns any such dataclass into frames
and back, checking everything a peer could get wrong:

    frame 0      msgpack map: {"v": version, "t": type tag, <the dataclass's header fields>}
    frame 1..n   payload frames (a field marked `frames_field()`), never embedded in msgpack

`Codec.decode` bounds a request header before it is built (`DecodeLimits`: its bytes, each string's
and list's length, and for a request its shape: one map holding scalars and flat lists, which
is all a request is; anything nested fails at the second container, before memory grows), then
checks the version (and that the type exists in it), the type tag, every field's
type, unknown fields and the payload frame count, then the message's own `check()`; anything
else raises `ProtocolError` with a code the server sends back in an error reply.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

import msgpack

from hicache_client.errors import StorageError

# A frame as it is sent (bytes or any buffer) or received (zmq.Frame exposes `.buffer`).
Buffer = Union[bytes, bytearray, memoryview]


class ErrorCode:
    """The `code` of an error reply."""

    MALFORMED = "malformed"  # not msgpack, truncated, wrong field types, wrong frame count
    BAD_VERSION = "bad_version"  # a protocol version this server does not speak
    UNKNOWN_TYPE = "unknown_type"  # a type tag that is not a request
    UNAUTHORIZED = "unauthorized"  # missing or wrong auth token
    TOO_LARGE = "too_large"  # a frame over --max-frame-bytes, or too many frames
    INTERNAL = "internal"  # the server failed to execute a well-formed request
    BUSY = "busy"  # too many reply bytes held for this connection (or all): read the replies
    NO_SHM = "no_shm"  # shared memory the request needs is not there (see docs): map or attach
    PIN_LIMIT = "pin_limit"  # a pin past the pinned-bytes limit (--pin-share): nothing pinned
    FORBIDDEN = "forbidden"  # a tenant token without the right (read, write, clear) asked for
    HELLO = "hello"  # a token proof on a connection the server has no hello of: say hello again


class ProtocolError(StorageError):
    """A message could not be decoded (or was refused); `code` is an `ErrorCode`."""

    def __init__(self, code: str, message: str, request_id: int = 0) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass
class Message:
    TYPE: ClassVar[str] = ""
    request_id: int = 0

    def check(self) -> None:
        """Cross-field checks after the per-field type checks (raise `ProtocolError`)."""


@dataclass
class Request(Message):
    token: str = ""


@dataclass
class Reply(Message):
    pass


def frames_field() -> Any:
    """A field carried as payload frames after the header, not inside it."""
    return field(default_factory=list, metadata={"frames": True})


def nbytes(buf: Any) -> int:
    if isinstance(buf, (bytes, bytearray)):
        return len(buf)
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    return mv.nbytes


@dataclass(frozen=True)
class _Schema:
    cls: Any
    header_fields: tuple[tuple[str, Any], ...]  # (name, resolved type) carried in frame 0
    frames_field: str | None  # name of the payload-frames field, if any


def _schema(cls: type) -> _Schema:
    hints = typing.get_type_hints(cls)
    header: list[tuple[str, Any]] = []
    frames: str | None = None
    for f in dataclasses.fields(cls):
        if f.metadata.get("frames"):
            frames = f.name
        else:
            header.append((f.name, hints[f.name]))
    return _Schema(cls, tuple(header), frames)


def _conforms(value: Any, tp: Any) -> bool:
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            _conforms(k, args[0]) and _conforms(v, args[1]) for k, v in value.items()
        )
    raise TypeError(f"protocol field type {tp!r} is not supported")  # a bug in the protocol


@dataclass(frozen=True)
class DecodeLimits:
    """What one header may hold, checked while msgpack builds it (so before any token check):
    `header_bytes` of frame 0, `items` in a list or map (a request's keys: --max-keys),
    `str_bytes` in one string; a request is one map of scalars and at most `request_lists`
    flat lists (an 8 MiB header of 8M empty maps cost 633 MiB before these limits)."""

    header_bytes: int = 8 << 20
    items: int = 1 << 16
    str_bytes: int = 1 << 20
    request_lists: int = 4


DEFAULT_LIMITS = DecodeLimits()


class _Shape:
    """msgpack hooks that stop a request header at its first container past a request's
    shape (called as each container completes, innermost first)."""

    def __init__(self, lists: int) -> None:
        self.maps = 0
        self.lists = lists

    def map_done(self, value: dict[Any, Any]) -> dict[Any, Any]:
        self.maps += 1
        if self.maps > 1:
            raise ValueError("a request header holds no nested map")
        return value

    def list_done(self, items: list[Any]) -> list[Any]:
        # Lists nested in lists complete first, so a list of lists stops here too; the field
        # types are checked once the header is built.
        self.lists -= 1
        if self.lists < 0:
            raise ValueError("a request header holds only a few flat lists")
        return items


def unpack_header(header: Buffer, limits: DecodeLimits = DEFAULT_LIMITS,
                  request: bool = False) -> Any:
    """Frame 0 decoded under `limits` (raises ValueError or msgpack's errors); a reply (not
    `request`) only under msgpack's own limits: it comes from the server a client chose, and
    an admin reply (stats of every namespace, every pin) may be longer than any request."""
    if not request:
        return msgpack.unpackb(header, raw=False, use_list=True, strict_map_key=True)
    if nbytes(header) > limits.header_bytes:
        raise ValueError(f"header is {nbytes(header)} bytes; at most {limits.header_bytes}")
    shape = _Shape(limits.request_lists)
    return msgpack.unpackb(
        header, raw=False, use_list=True, strict_map_key=True,
        max_str_len=limits.str_bytes, max_bin_len=limits.str_bytes,
        max_array_len=limits.items, max_map_len=limits.items, max_ext_len=0,
        object_hook=shape.map_done, list_hook=shape.list_done)


def peek_request_id(header: Buffer, limits: DecodeLimits = DEFAULT_LIMITS) -> int:
    """Best-effort request id of an undecodable message (0 when none can be read); decoded
    under the request limits, so a hostile header costs no more here than in `decode`."""
    try:
        h = unpack_header(header, limits, request=True)
        rid = h.get("id", 0) if isinstance(h, dict) else 0
        return rid if isinstance(rid, int) and not isinstance(rid, bool) else 0
    except Exception:  # noqa: BLE001 - any garbage
        return 0


class Codec:
    """Encodes and decodes the messages of one protocol.

    `requests` / `replies`: the message dataclasses (each with a `TYPE` tag and a `check()`);
    `since`: the protocol version that introduced each tag (1 when not listed): a message is
    encoded with that version, so an older peer that never sends a newer type interoperates;
    `versions`: the versions this side decodes. `wire_names`: short names on the wire for
    fields every message has.
    """

    def __init__(
        self,
        requests: Iterable[Any],
        replies: Iterable[Any],
        since: dict[str, int],
        versions: Sequence[int],
        wire_names: dict[str, str],
    ) -> None:
        requests, replies = tuple(requests), tuple(replies)
        self.schemas: dict[str, _Schema] = {c.TYPE: _schema(c) for c in (*requests, *replies)}
        self._tags = {
            "request": frozenset(c.TYPE for c in requests),
            "reply": frozenset(c.TYPE for c in replies),
        }
        self.since = since
        self.versions = tuple(versions)
        self.wire_names = wire_names

    def encode(self, msg: Any) -> list[Buffer]:
        """Frames of `msg`: the msgpack header, then its payload frames (not copied)."""
        schema = self.schemas[msg.TYPE]
        header: dict[str, Any] = {"v": self.since.get(msg.TYPE, 1), "t": msg.TYPE}
        for name, _tp in schema.header_fields:
            header[self.wire_names.get(name, name)] = getattr(msg, name)
        frames: list[Buffer] = [msgpack.packb(header, use_bin_type=True)]
        if schema.frames_field:
            frames.extend(getattr(msg, schema.frames_field))
        return frames

    def decode(self, frames: Sequence[Buffer], *, expect: str = "any",
               limits: DecodeLimits = DEFAULT_LIMITS) -> Any:
        """Decode one message from its frames. `expect` is "request", "reply" or "any";
        `limits` bound the header as it is decoded (a request's also by shape).

        Raises `ProtocolError` (never anything else) for any frame sequence that is not a valid
        message of the expected kind.
        """
        if not frames:
            raise ProtocolError(ErrorCode.MALFORMED, "empty message")
        try:
            header = unpack_header(frames[0], limits, request=expect == "request")
        except Exception as e:  # noqa: BLE001 - msgpack raises many types on garbage
            raise ProtocolError(ErrorCode.MALFORMED, f"header is not msgpack ({e})") from None
        if not isinstance(header, dict):
            raise ProtocolError(
                ErrorCode.MALFORMED, f"header is a {type(header).__name__}, not a map"
            )
        rid = header.get("id", 0)
        rid = rid if isinstance(rid, int) and not isinstance(rid, bool) else 0
        version = header.get("v")
        if type(version) is not int or version not in self.versions:
            raise ProtocolError(
                ErrorCode.BAD_VERSION,
                f"protocol version {version!r} is not supported (this side speaks "
                f"{', '.join(map(str, self.versions))})",
                rid,
            )
        tag = header.get("t")
        allowed = self._tags.get(expect, self.schemas.keys())
        if not isinstance(tag, str) or tag not in allowed:
            raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {tag!r}", rid)
        if version < self.since.get(tag, 1):
            raise ProtocolError(
                ErrorCode.BAD_VERSION, f"{tag} needs protocol version {self.since[tag]}", rid
            )
        schema = self.schemas[tag]
        kwargs: dict[str, Any] = {}
        expected_keys = {"v", "t"}
        for name, tp in schema.header_fields:
            wire = self.wire_names.get(name, name)
            expected_keys.add(wire)
            if wire not in header:
                raise ProtocolError(ErrorCode.MALFORMED, f"{tag}: field {wire!r} is missing", rid)
            value = header[wire]
            if not _conforms(value, tp):
                raise ProtocolError(
                    ErrorCode.MALFORMED,
                    f"{tag}: field {wire!r} has type {type(value).__name__}, expected {tp}",
                    rid,
                )
            kwargs[name] = value
        extra = set(header) - expected_keys
        if extra:
            raise ProtocolError(
                ErrorCode.MALFORMED, f"{tag}: unknown fields {sorted(extra)}", rid
            )
        payload = list(frames[1:])
        if schema.frames_field:
            kwargs[schema.frames_field] = payload
        elif payload:
            raise ProtocolError(
                ErrorCode.MALFORMED, f"{tag} carries {len(payload)} unexpected payload frames", rid
            )
        msg = schema.cls(**kwargs)
        msg.check()
        return msg
