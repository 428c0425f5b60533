"""The `hicache-server` wire protocol: every message declared once, shared by server and client.

A message is one ZeroMQ multipart message:

    frame 0      msgpack map: {"v": PROTOCOL_VERSION, "t": type tag, <the dataclass's fields>}
    frame 1..n   payload frames (page records), only for `SetRequest` and `GetReply`

Page records travel as separate frames, never embedded in msgpack, so they are sent and received
without copies (`copy=False`). Every request carries `request_id` (echoed in its reply) and
`token` (the shared auth token, "" when none). `decode` checks the version, the type tag, every
field's type and the payload frame count; anything else raises `ProtocolError` with a code that
the server sends back in an `ErrorReply`. The codec itself is `wire.py`; this module says which
messages exist.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hicache_client.remote import admin_protocol as A
from hicache_client.remote.admin_protocol import (  # noqa: F401 - re-exported
    AdminClearReply,
    AdminClearRequest,
    AdminLookupReply,
    AdminLookupRequest,
    AdminStatsReply,
    AdminStatsRequest,
    BindNamespaceReply,
    BindNamespaceRequest,
    PinReply,
    PinRequest,
    ShmReleaseReply,
    ShmReleaseRequest,
    UnpinReply,
    UnpinRequest,
)
from hicache_client.remote.wire import (  # noqa: F401 - re-exported: P.ErrorCode etc.
    DEFAULT_LIMITS,
    Buffer,
    Codec,
    DecodeLimits,
    ErrorCode,
    Message,
    ProtocolError,
    Reply,
    Request,
    frames_field,
    nbytes,
    peek_request_id,
)

# Version 2 adds the same-host shared-memory data path (`attach_shm`, `shm_get`, `shm_set`,
# `detach_shm`). A message is encoded with the lowest version that has its type (`_SINCE`), so a
# version-1 client and a version-2 server interoperate (the old client never sends a new type);
# a new client asking an old server to attach gets an error reply and stays on TCP frames.
# Version 3 adds the shared-memory store (`map_store`, `shm_locate`; server/arena.py).
# Version 4 adds writes into it (`shm_reserve`, `shm_commit`).
# Version 5 adds the namespace-scoped clear (`clear_namespace`); `clear` (every page of every
# namespace) stays, as the server admin's operation.
# Version 6 adds the admin API (`admin_lookup`, `pin`, `unpin`, `admin_clear`, `admin_stats`,
# with the admin token) and read leases (`shm_release`), and `bind_namespace`
# (`admin_protocol.py`).
# Version 7 adds tenants (`--tenants-file`, server/tenants.py): the admin's `reload_tenants`,
# and the `forbidden` error (a tenant token without the right a request needs). A tenant's
# requests are the same messages: the server scopes them by the token they carry. And token
# proofs (`hello`): a client proves it holds its token with an HMAC per request over a nonce the
# server gave its connection, and the server proves it holds the token too; the token itself
# never crosses the wire (`request_proof`, `server_proof`).
PROTOCOL_VERSION = 7
SUPPORTED_VERSIONS = (1, 2, 3, 4, 5, 6, 7)

# --------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------


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
    frames: list[Buffer] = frames_field()  # one per present key, in key order

    def check(self) -> None:
        present = [n for n in self.lengths if n >= 0]
        if len(present) != len(self.frames):
            raise ProtocolError(
                ErrorCode.MALFORMED,
                f"get reply names {len(present)} records but carries {len(self.frames)} frames",
                self.request_id,
            )
        for n, f in zip(present, self.frames):
            if n != nbytes(f):
                raise ProtocolError(
                    ErrorCode.MALFORMED, f"record frame is {nbytes(f)} bytes, header says {n}"
                )


@dataclass
class SetRequest(Request):
    TYPE: ClassVar[str] = "set"
    keys: list[str] = field(default_factory=list)
    frames: list[Buffer] = frames_field()  # one record per key

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
class ClearNamespaceRequest(Request):
    """Delete every page whose record header names this namespace (64 lower-case hex: the
    32-byte seed), in memory and on disk; other namespaces' pages stay."""

    TYPE: ClassVar[str] = "clear_namespace"
    namespace: str = ""

    def check(self) -> None:
        ns = self.namespace
        if len(ns) != 64 or ns.strip("0123456789abcdef"):
            raise ProtocolError(ErrorCode.MALFORMED,
                                "namespace must be 64 lower-case hex characters",
                                self.request_id)


@dataclass
class ClearNamespaceReply(Reply):
    TYPE: ClassVar[str] = "clear_namespace_ok"
    deleted: int = 0


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
class ShmReserveRequest(Request):
    """Reserve room in the server's arena for records of `lengths[i]` bytes, which the client
    (mapping the arena read-write) then writes and stores with `shm_commit`. Refused with
    `no_shm` when `arena_id` is not the server's arena."""

    TYPE: ClassVar[str] = "shm_reserve"
    arena_id: int = 0
    lengths: list[int] = field(default_factory=list)


@dataclass
class ShmReserveReply(Reply):
    """Per length asked: the byte offset reserved in the arena and that slot's generation
    (offset -1: no room, over this connection's share, or a record the store does not take).
    A reservation is this connection's until committed, or until `expires_ms` from now."""

    TYPE: ClassVar[str] = "shm_reserve_ok"
    offsets: list[int] = field(default_factory=list)
    gens: list[int] = field(default_factory=list)
    expires_ms: int = 0

    def check(self) -> None:
        _check_descriptors(self, self.offsets, self.gens, self.gens)


@dataclass
class ShmCommitRequest(Request):
    """Store the records written into this connection's reservations: key i is the record at
    `offsets[i]` (its length as reserved); a reservation that is not this connection's or has
    expired stores nothing. `reserve`: lengths to reserve anew in the same round trip (a client
    writing batches of alike records has the next batch's room ready)."""

    TYPE: ClassVar[str] = "shm_commit"
    arena_id: int = 0
    keys: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    reserve: list[int] = field(default_factory=list)

    def check(self) -> None:
        _check_descriptors(self, self.keys, self.offsets, self.offsets)


@dataclass
class ShmCommitReply(Reply):
    """`stored` per key committed; `offsets`, `gens` and `expires_ms` answer `reserve` as
    `ShmReserveReply` does."""

    TYPE: ClassVar[str] = "shm_commit_ok"
    stored: list[bool] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    gens: list[int] = field(default_factory=list)
    expires_ms: int = 0

    def check(self) -> None:
        _check_descriptors(self, self.offsets, self.gens, self.gens)


@dataclass
class HelloRequest(Request):
    """Start token proofs on this connection (sent with an empty `token`): `token_id` names the
    client's token (`token_id()`: a digest, not the token), `client_nonce` is 32 random bytes
    (hex). Answered with the connection's nonce, or `unauthorized` for a token the server
    does not know."""

    TYPE: ClassVar[str] = "hello"
    token_id: str = ""
    client_nonce: str = ""


@dataclass
class HelloReply(Reply):
    """`nonce` (hex): what every later request's proof covers (`request_proof`); `proof`:
    `server_proof(token, nonce, client_nonce)`, which only a server holding the token makes;
    `signature` (hex): the server key's Ed25519 signature over the hello's transcript
    (`hicache_client.remote.identity.transcript`), "" for a server without --server-key."""

    TYPE: ClassVar[str] = "hello_ok"
    nonce: str = ""
    proof: str = ""
    signature: str = ""


# The `token` field of a request that proves its token instead of carrying it:
# "p1:<token_id>:<HMAC-SHA256(token, nonce || request_id (8 bytes LE) || type)>".
PROOF_PREFIX = "p1:"


def token_id(token: str) -> str:
    """A token's public name in `hello` and proofs (a digest: says nothing of the token)."""
    return hashlib.sha256(b"hicache-token-id\0" + token.encode()).hexdigest()[:32]


def request_proof(token: str, nonce: bytes, request_id: int, type_tag: str) -> str:
    """The `token` field of request `request_id` of type `type_tag` on a connection whose
    server nonce is `nonce`."""
    # Two's complement in 8 bytes: the signed ids' bytes as before, and an id msgpack carries
    # up to 2^64 - 1 (it overflowed a signed conversion: an internal error with id 0).
    mac = hmac.new(token.encode(), nonce + (request_id % (1 << 64)).to_bytes(8, "little")
                   + type_tag.encode(), hashlib.sha256).hexdigest()
    return f"{PROOF_PREFIX}{token_id(token)}:{mac}"


def server_proof(token: str, nonce: bytes, client_nonce: bytes) -> str:
    """What a server that holds `token` answers to a hello (`HelloReply.proof`)."""
    return hmac.new(token.encode(), b"hicache-server\0" + nonce + client_nonce,
                    hashlib.sha256).hexdigest()


@dataclass
class ReloadTenantsRequest(Request):
    """Read the tenants file again (the admin token): added, removed and rotated tokens take
    effect from the next request; a file that does not load changes nothing (an error reply)."""

    TYPE: ClassVar[str] = "reload_tenants"


@dataclass
class ReloadTenantsReply(Reply):
    TYPE: ClassVar[str] = "reload_tenants_ok"
    summary: str = ""  # tenants and tokens now, how many added and removed (never a token)


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
    ShmReserveRequest,
    ShmCommitRequest,
    ClearNamespaceRequest,
    *A.REQUESTS,
    ReloadTenantsRequest,
    HelloRequest,
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
    ShmReserveReply,
    ShmCommitReply,
    ClearNamespaceReply,
    *A.REPLIES,
    ReloadTenantsReply,
    HelloReply,
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
} | {c.TYPE: 3 for c in (MapStoreRequest, MapStoreReply, ShmLocateRequest, ShmLocateReply)} | {
    c.TYPE: 4
    for c in (ShmReserveRequest, ShmReserveReply, ShmCommitRequest, ShmCommitReply)
} | {c.TYPE: 5 for c in (ClearNamespaceRequest, ClearNamespaceReply)} | {
    c.TYPE: A.VERSION for c in (*A.REQUESTS, *A.REPLIES)} | {
    c.TYPE: 7 for c in (ReloadTenantsRequest, ReloadTenantsReply, HelloRequest, HelloReply,
                        A.AdminPinsRequest, A.AdminPinsReply)}
ADMIN_TYPES = A.ADMIN_TYPES | {ReloadTenantsRequest.TYPE}

CODEC = Codec(REQUEST_TYPES, REPLY_TYPES, _SINCE, SUPPORTED_VERSIONS,
               wire_names={"request_id": "id", "token": "auth"})
SCHEMAS = CODEC.schemas


def encode(msg: Message) -> list[Buffer]:
    """Frames of `msg`: the msgpack header, then its payload frames (not copied)."""
    return CODEC.encode(msg)


def decode(frames: Sequence[Buffer], *, expect: str = "any",
           limits: DecodeLimits = DEFAULT_LIMITS) -> Message:
    """One message from its frames (`expect`: "request", "reply" or "any"; `limits`: what its
    header may hold); raises `ProtocolError`, never anything else, for frames that are not a
    valid message."""
    msg: Message = CODEC.decode(frames, expect=expect, limits=limits)
    return msg


