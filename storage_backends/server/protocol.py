"""The `hicache-server` wire protocol: every message declared once, shared by server and client.

A message is one ZeroMQ multipart message:

    frame 0      msgpack map: {"v": PROTOCOL_VERSION, "t": type tag, <the dataclass's fields>}
    frame 1..n   payload frames (page records), only for `SetRequest` and `GetReply`

Page records travel as separate frames, never embedded in msgpack, so they are sent and received
without copies (`copy=False`). Every request carries `request_id` (echoed in its reply) and
`token` (the shared auth token, "" when none). `decode` checks the version, the type tag, every
field's type and the payload frame count; anything else raises `ProtocolError` with a code that
the server sends back in an `ErrorReply`.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

import msgpack

from hicache.errors import StorageError

# Version 2 adds the same-host shared-memory data path (`attach_shm`, `shm_get`, `shm_set`,
# `detach_shm`). A message is encoded with the lowest version that has its type (`_SINCE`), so a
# version-1 client and a version-2 server interoperate (the old client never sends a new type);
# a new client asking an old server to attach gets an error reply and stays on TCP frames.
# Version 3 adds the shared-memory store (`map_store`, `shm_locate`; server/arena.py).
PROTOCOL_VERSION = 3
SUPPORTED_VERSIONS = (1, 2, 3)

# A frame as it is sent (bytes or any buffer) or received (zmq.Frame exposes `.buffer`).
Buffer = Union[bytes, bytearray, memoryview]


class ErrorCode:
    """The `code` of an `ErrorReply`."""

    MALFORMED = "malformed"  # not msgpack, truncated, wrong field types, wrong frame count
    BAD_VERSION = "bad_version"  # a protocol version this server does not speak
    UNKNOWN_TYPE = "unknown_type"  # a type tag that is not a request
    UNAUTHORIZED = "unauthorized"  # missing or wrong auth token
    TOO_LARGE = "too_large"  # a frame over --max-frame-bytes, or too many frames
    INTERNAL = "internal"  # the server failed to execute a well-formed request
    BUSY = "busy"  # too many reply bytes held for this connection (or all): read the replies
    NO_SHM = "no_shm"  # shm_get / shm_set on a connection with no attached region: re-attach


class ProtocolError(StorageError):
    """A message could not be decoded (or was refused); `code` is an `ErrorCode`."""

    def __init__(self, code: str, message: str, request_id: int = 0) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


# --------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------


def _frames_field() -> Any:
    """A field carried as payload frames after the header, not inside it."""
    return field(default_factory=list, metadata={"frames": True})


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


@dataclass
class PingRequest(Request):
    TYPE: ClassVar[str] = "ping"


@dataclass
class PingReply(Reply):
    TYPE: ClassVar[str] = "pong"
    server_version: str = ""
    protocol_version: int = PROTOCOL_VERSION
    max_frame_bytes: int = 0


@dataclass
class ExistsRequest(Request):
    TYPE: ClassVar[str] = "exists"
    keys: list[str] = field(default_factory=list)


@dataclass
class ExistsReply(Reply):
    TYPE: ClassVar[str] = "exists_ok"
    count: int = 0  # length of the leading run of keys present


@dataclass
class GetRequest(Request):
    TYPE: ClassVar[str] = "get"
    keys: list[str] = field(default_factory=list)


@dataclass
class GetReply(Reply):
    TYPE: ClassVar[str] = "get_ok"
    lengths: list[int] = field(default_factory=list)  # per key: record bytes, -1 when absent
    frames: list[Buffer] = _frames_field()  # one per present key, in key order

    def check(self) -> None:
        present = [n for n in self.lengths if n >= 0]
        if len(present) != len(self.frames):
            raise ProtocolError(
                ErrorCode.MALFORMED,
                f"get reply names {len(present)} records but carries {len(self.frames)} frames",
                self.request_id,
            )
        for n, f in zip(present, self.frames):
            if n != _nbytes(f):
                raise ProtocolError(
                    ErrorCode.MALFORMED, f"record frame is {_nbytes(f)} bytes, header says {n}"
                )


@dataclass
class SetRequest(Request):
    TYPE: ClassVar[str] = "set"
    keys: list[str] = field(default_factory=list)
    frames: list[Buffer] = _frames_field()  # one record per key

    def check(self) -> None:
        if len(self.keys) != len(self.frames):
            raise ProtocolError(
                ErrorCode.MALFORMED,
                f"set names {len(self.keys)} keys but carries {len(self.frames)} frames",
                self.request_id,
            )


@dataclass
class SetReply(Reply):
    TYPE: ClassVar[str] = "set_ok"
    stored: list[bool] = field(default_factory=list)


@dataclass
class DeleteRequest(Request):
    TYPE: ClassVar[str] = "delete"
    keys: list[str] = field(default_factory=list)


@dataclass
class DeleteReply(Reply):
    TYPE: ClassVar[str] = "delete_ok"
    deleted: int = 0


@dataclass
class ClearRequest(Request):
    TYPE: ClassVar[str] = "clear"


@dataclass
class ClearReply(Reply):
    TYPE: ClassVar[str] = "clear_ok"


@dataclass
class StatsRequest(Request):
    TYPE: ClassVar[str] = "stats"


@dataclass
class StatsReply(Reply):
    TYPE: ClassVar[str] = "stats_ok"
    stats: dict[str, int] = field(default_factory=dict)


@dataclass
class AttachShmRequest(Request):
    """Offer the server a shared-memory region (a file in /dev/shm, mode 0600) for this
    connection's page bytes. Refused (an error reply) when the server cannot open it."""

    TYPE: ClassVar[str] = "attach_shm"
    name: str = ""  # file name in /dev/shm (no directory)
    size: int = 0  # its exact size in bytes


@dataclass
class AttachShmReply(Reply):
    TYPE: ClassVar[str] = "attach_shm_ok"


@dataclass
class DetachShmRequest(Request):
    TYPE: ClassVar[str] = "detach_shm"


@dataclass
class DetachShmReply(Reply):
    TYPE: ClassVar[str] = "detach_shm_ok"


def _check_descriptors(
    msg: Message, keys: list[Any], offsets: list[int], sizes: list[int]
) -> None:
    if not len(keys) == len(offsets) == len(sizes):
        raise ProtocolError(
            ErrorCode.MALFORMED,
            f"{msg.TYPE}: {len(keys)} keys, {len(offsets)} offsets, {len(sizes)} sizes",
            msg.request_id,
        )


@dataclass
class ShmSetRequest(Request):
    """Store records the client wrote into its attached region: key i is the bytes
    [offsets[i], offsets[i] + lengths[i]). Answered with `SetReply`."""

    TYPE: ClassVar[str] = "shm_set"
    keys: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def check(self) -> None:
        _check_descriptors(self, self.keys, self.offsets, self.lengths)


@dataclass
class ShmGetRequest(Request):
    """Read records into the client's attached region: key i into the slot
    [offsets[i], offsets[i] + capacities[i]). Answered with `ShmGetReply`."""

    TYPE: ClassVar[str] = "shm_get"
    keys: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    capacities: list[int] = field(default_factory=list)

    def check(self) -> None:
        _check_descriptors(self, self.keys, self.offsets, self.capacities)


@dataclass
class ShmGetReply(Reply):
    """Per key: the stored record's length (-1: absent). Only a record that fits its slot
    (length <= capacity) was written into it; a longer one was not written at all."""

    TYPE: ClassVar[str] = "shm_get_ok"
    lengths: list[int] = field(default_factory=list)


@dataclass
class MapStoreRequest(Request):
    """Ask for the server's shared-memory store (its arena in /dev/shm), to map read-only."""
    TYPE: ClassVar[str] = "map_store"


@dataclass
class MapStoreReply(Reply):
    TYPE: ClassVar[str] = "map_store_ok"
    name: str = ""  # file name in /dev/shm
    size: int = 0  # the file's size in bytes
    arena_id: int = 0  # also in the file's header: proves it is this server's arena


@dataclass
class ShmLocateRequest(Request):
    """Where the records of `keys` are in the server's arena. Counts as a get (recency, hits).
    Refused with `no_shm` when `arena_id` is not the server's arena (it restarted: map again)."""

    TYPE: ClassVar[str] = "shm_locate"
    arena_id: int = 0  # the arena the client has mapped
    keys: list[str] = field(default_factory=list)


@dataclass
class ShmLocateReply(Reply):
    """Per key: the record's length (-1: absent) and, when it is in the arena, its byte offset
    and generation (offset -1: present but not in the arena; read it with `shm_get`). A copy is
    valid when the generation entry of its first block still holds `gens[i]` after copying."""

    TYPE: ClassVar[str] = "shm_locate_ok"
    arena_id: int = 0
    offsets: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    gens: list[int] = field(default_factory=list)

    def check(self) -> None:
        _check_descriptors(self, self.gens, self.offsets, self.lengths)


@dataclass
class ErrorReply(Reply):
    TYPE: ClassVar[str] = "error"
    code: str = ErrorCode.INTERNAL
    message: str = ""


REQUEST_TYPES: tuple[type[Request], ...] = (
    PingRequest,
    ExistsRequest,
    GetRequest,
    SetRequest,
    DeleteRequest,
    ClearRequest,
    StatsRequest,
    AttachShmRequest,
    DetachShmRequest,
    ShmSetRequest,
    ShmGetRequest,
    MapStoreRequest,
    ShmLocateRequest,
)
REPLY_TYPES: tuple[type[Reply], ...] = (
    PingReply,
    ExistsReply,
    GetReply,
    SetReply,
    DeleteReply,
    ClearReply,
    StatsReply,
    ErrorReply,
    AttachShmReply,
    DetachShmReply,
    ShmGetReply,
    MapStoreReply,
    ShmLocateReply,
)
# The protocol version that introduced each message type (1 when not listed).
_SINCE: dict[str, int] = {
    c.TYPE: 2
    for c in (
        AttachShmRequest,
        AttachShmReply,
        DetachShmRequest,
        DetachShmReply,
        ShmSetRequest,
        ShmGetRequest,
        ShmGetReply,
    )
} | {c.TYPE: 3 for c in (MapStoreRequest, MapStoreReply, ShmLocateRequest, ShmLocateReply)}


@dataclass(frozen=True)
class _Schema:
    cls: type[Message]
    header_fields: tuple[tuple[str, Any], ...]  # (name, resolved type) carried in frame 0
    frames_field: str | None  # name of the payload-frames field, if any


def _schema(cls: type[Message]) -> _Schema:
    hints = typing.get_type_hints(cls)
    header: list[tuple[str, Any]] = []
    frames: str | None = None
    for f in dataclasses.fields(cls):
        if f.metadata.get("frames"):
            frames = f.name
        else:
            header.append((f.name, hints[f.name]))
    return _Schema(cls, tuple(header), frames)


SCHEMAS: dict[str, _Schema] = {c.TYPE: _schema(c) for c in (*REQUEST_TYPES, *REPLY_TYPES)}
_REQUEST_TAGS = frozenset(c.TYPE for c in REQUEST_TYPES)
_REPLY_TAGS = frozenset(c.TYPE for c in REPLY_TYPES)
# Short wire names for the envelope fields that every message has.
_WIRE_NAMES = {"request_id": "id", "token": "auth"}


def _nbytes(buf: Any) -> int:
    if isinstance(buf, (bytes, bytearray)):
        return len(buf)
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    return mv.nbytes


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
    raise TypeError(f"protocol field type {tp!r} is not supported")  # a bug in this module


# --------------------------------------------------------------------------------------------
# Encoding and decoding
# --------------------------------------------------------------------------------------------


def encode(msg: Message) -> list[Buffer]:
    """Frames of `msg`: the msgpack header, then its payload frames (not copied)."""
    schema = SCHEMAS[msg.TYPE]
    header: dict[str, Any] = {"v": _SINCE.get(msg.TYPE, 1), "t": msg.TYPE}
    for name, _tp in schema.header_fields:
        header[_WIRE_NAMES.get(name, name)] = getattr(msg, name)
    frames: list[Buffer] = [msgpack.packb(header, use_bin_type=True)]
    if schema.frames_field:
        frames.extend(getattr(msg, schema.frames_field))
    return frames


def peek_request_id(header: Buffer) -> int:
    """Best-effort request id of an undecodable message (0 when none can be read)."""
    try:
        h = msgpack.unpackb(header, raw=False)
        rid = h.get("id", 0) if isinstance(h, dict) else 0
        return rid if isinstance(rid, int) and not isinstance(rid, bool) else 0
    except Exception:  # noqa: BLE001 - any garbage
        return 0


def decode(frames: Sequence[Buffer], *, expect: str = "any") -> Message:
    """Decode one message from its frames. `expect` is "request", "reply" or "any".

    Raises `ProtocolError` (never anything else) for any frame sequence that is not a valid
    message of the expected kind.
    """
    if not frames:
        raise ProtocolError(ErrorCode.MALFORMED, "empty message")
    try:
        header = msgpack.unpackb(frames[0], raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises many types on garbage
        raise ProtocolError(ErrorCode.MALFORMED, f"header is not msgpack ({e})") from None
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.MALFORMED, f"header is a {type(header).__name__}, not a map")
    rid = header.get("id", 0)
    rid = rid if isinstance(rid, int) and not isinstance(rid, bool) else 0
    version = header.get("v")
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        raise ProtocolError(
            ErrorCode.BAD_VERSION,
            f"protocol version {version!r} is not supported (this side speaks "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))})",
            rid,
        )
    tag = header.get("t")
    allowed = {"request": _REQUEST_TAGS, "reply": _REPLY_TAGS}.get(expect, SCHEMAS.keys())
    if not isinstance(tag, str) or tag not in allowed:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {tag!r}", rid)
    if version < _SINCE.get(tag, 1):
        raise ProtocolError(
            ErrorCode.BAD_VERSION, f"{tag} needs protocol version {_SINCE[tag]}", rid
        )
    schema = SCHEMAS[tag]
    kwargs: dict[str, Any] = {}
    expected_keys = {"v", "t"}
    for name, tp in schema.header_fields:
        wire = _WIRE_NAMES.get(name, name)
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
        raise ProtocolError(ErrorCode.MALFORMED, f"{tag}: unknown fields {sorted(extra)}", rid)
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
