"""The hicache-server wire protocol: every message type round-trips; bad frames are refused with
a `ProtocolError` naming the right code, never any other exception."""

from __future__ import annotations

import contextlib
import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_client.remote import admin_protocol as A
from hicache_client.remote import protocol as P

SAMPLES: list[P.Message] = [
    P.PingRequest(request_id=1, token="t"),
    P.PingReply(request_id=1, server_version="0.1.0", protocol_version=1, max_frame_bytes=99),
    P.ExistsRequest(request_id=2, token="", keys=["a", "b"]),
    P.ExistsReply(request_id=2, count=1),
    P.GetRequest(request_id=3, token="tok", keys=["a", "b", "c"]),
    P.GetReply(request_id=3, lengths=[3, -1, 0], frames=[b"abc", b""]),
    P.SetRequest(request_id=4, token="tok", keys=["a", "b"], frames=[b"x" * 100, b"yz"]),
    P.SetReply(request_id=4, stored=[True, False]),
    P.DeleteRequest(request_id=5, keys=["a"]),
    P.DeleteReply(request_id=5, deleted=1),
    P.ClearRequest(request_id=6, token="tok"),
    P.ClearReply(request_id=6),
    P.ClearNamespaceRequest(request_id=6, token="tok", namespace="ab" * 32),
    P.ClearNamespaceReply(request_id=6, deleted=3),
    P.StatsRequest(request_id=7),
    P.StatsReply(request_id=7, stats={"pages": 3, "bytes": 12}),
    P.ErrorReply(request_id=8, code=P.ErrorCode.UNAUTHORIZED, message="no"),
    P.AttachShmRequest(request_id=9, token="tok", name="hicache-1-ab", size=1 << 24),
    P.AttachShmReply(request_id=9),
    P.DetachShmRequest(request_id=10, token="tok"),
    P.DetachShmReply(request_id=10),
    P.ShmSetRequest(request_id=11, keys=["a", "b"], offsets=[0, 100], lengths=[100, 7]),
    P.ShmGetRequest(request_id=12, keys=["a", "b"], offsets=[0, 100], capacities=[100, 7]),
    P.ShmGetReply(request_id=12, lengths=[100, -1]),
    P.MapStoreRequest(request_id=13),
    P.MapStoreReply(request_id=13, name="hicache-store-1-ab", size=1 << 20, arena_id=2**62 + 1),
    P.ShmLocateRequest(request_id=14, arena_id=7, keys=["a", "b", "c"]),
    P.ShmLocateReply(request_id=14, arena_id=7, offsets=[4096, -1, -1], lengths=[100, -1, 9],
                     gens=[3, 0, 0]),
    P.ShmReserveRequest(request_id=15, arena_id=7, lengths=[4096, 9]),
    P.ShmReserveReply(request_id=15, offsets=[8192, -1], gens=[5, 0], expires_ms=30000),
    P.ShmCommitRequest(request_id=16, arena_id=7, keys=["a"], offsets=[8192], reserve=[4096]),
    P.ShmCommitReply(request_id=16, stored=[True], offsets=[16384], gens=[9], expires_ms=30000),
    P.BindNamespaceRequest(request_id=17, token="tok", namespace="cd" * 32),
    P.BindNamespaceReply(request_id=17),
    P.ShmReleaseRequest(request_id=18, arena_id=7, offsets=[4096, 8192]),
    P.ShmReleaseReply(request_id=18, released=2),
    P.AdminLookupRequest(request_id=19, token="adm", keys=["a", "b"]),
    P.AdminLookupReply(request_id=19, count=2, in_memory=1, pinned=1),
    P.PinRequest(request_id=20, token="adm", keys=["a"], ttl_ms=5000, require_all=True),
    P.PinReply(request_id=20, pinned=1, absent=0, pinned_bytes=4096, limit_bytes=1 << 20),
    P.UnpinRequest(request_id=21, token="adm", keys=["a"]),
    P.UnpinReply(request_id=21, unpinned=1),
    P.AdminClearRequest(request_id=22, token="adm", namespace="ef" * 32, all=False),
    P.AdminClearReply(request_id=22, deleted=4, unpinned=1),
    P.AdminStatsRequest(request_id=23, token="adm"),
    P.AdminStatsReply(request_id=23, namespaces={"ef" * 32: {"pages": 1, "hits": 2}},
                      totals={"pages": 1}),
    A.AdminPinsRequest(request_id=25, token="adm"),
    A.AdminPinsReply(request_id=25, keys=["a", "b"], namespaces=["ef" * 32, "-"],
                     sizes=[4096, -1], ttl_left_ms=[-1, 1500], limit_bytes=1 << 20),
    P.ReloadTenantsRequest(request_id=24, token="adm"),
    P.ReloadTenantsReply(request_id=24, summary="2 tenants, 3 tokens (1 added, 1 removed)"),
    P.HelloRequest(request_id=25, token_id="ab" * 16, client_nonce="cd" * 32),
    P.HelloReply(request_id=25, nonce="ef" * 32, proof="01" * 32),
]


def _normalise(msg: P.Message) -> dict[str, object]:
    d = dataclasses.asdict(msg)
    if "frames" in d:
        d["frames"] = [bytes(f) for f in d["frames"]]
    return d


def test_every_message_type_has_a_sample() -> None:
    assert {type(m) for m in SAMPLES} == set(P.REQUEST_TYPES) | set(P.REPLY_TYPES)
    tags = [c.TYPE for c in (*P.REQUEST_TYPES, *P.REPLY_TYPES)]
    assert len(set(tags)) == len(tags)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: P.Message) -> None:
    frames = P.encode(msg)
    back = P.decode(frames)
    assert type(back) is type(msg)
    assert _normalise(back) == _normalise(msg)
    kind = "request" if isinstance(msg, P.Request) else "reply"
    assert type(P.decode(frames, expect=kind)) is type(msg)
    other = "reply" if kind == "request" else "request"
    with pytest.raises(P.ProtocolError) as e:
        P.decode(frames, expect=other)
    # A reply holding nested containers is stopped by the request shape check first (while
    # it is decoded, before its type tag is read).
    nested = kind == "reply" and any(
        isinstance(v, dict) or (isinstance(v, list) and any(isinstance(x, (dict, list)) for x in v))
        for k, v in vars(msg).items() if k != "frames")
    assert e.value.code == (P.ErrorCode.MALFORMED if nested else P.ErrorCode.UNKNOWN_TYPE)


def test_payload_frames_are_not_copied_into_the_header() -> None:
    big = memoryview(bytearray(1 << 20))
    frames = P.encode(P.SetRequest(keys=["k"], frames=[big]))
    assert len(frames) == 2
    assert frames[1] is big
    assert len(frames[0]) < 100


def test_header_carries_the_version_and_wire_names() -> None:
    header = msgpack.unpackb(P.encode(P.GetRequest(request_id=9, token="s", keys=["k"]))[0])
    assert header == {"v": 1, "t": "get", "id": 9, "auth": "s", "keys": ["k"]}


def test_each_type_is_encoded_with_the_version_that_introduced_it() -> None:
    """Version-1 types stay version 1 on the wire (a version-1 peer reads them); the
    shared-memory region types say 2, the shared-memory store types 3, writes into it 4, the
    namespace clear 5, the admin API and read leases 6, the tenants file's reload, the token
    proofs and the pin list 7."""
    assert P.PROTOCOL_VERSION == 7
    v2 = {"attach_shm", "attach_shm_ok", "detach_shm", "detach_shm_ok", "shm_set", "shm_get",
          "shm_get_ok"}
    v3 = {"map_store", "map_store_ok", "shm_locate", "shm_locate_ok"}
    v4 = {"shm_reserve", "shm_reserve_ok", "shm_commit", "shm_commit_ok"}
    v5 = {"clear_namespace", "clear_namespace_ok"}
    for msg in SAMPLES:
        header = msgpack.unpackb(P.encode(msg)[0])
        want = (7 if msg.TYPE.startswith(("reload_tenants", "hello", "admin_pins"))
                else 6 if msg.TYPE.startswith(("admin_", "pin_ok", "unpin", "bind_", "shm_release"))
                or msg.TYPE == "pin"
                else 5 if msg.TYPE in v5 else 4 if msg.TYPE in v4 else 3 if msg.TYPE in v3
                else 2 if msg.TYPE in v2 else 1)
        assert header["v"] == want, msg.TYPE
    # A namespace clear that names no valid namespace is refused before it runs.
    with pytest.raises(P.ProtocolError) as e:
        P.decode([msgpack.packb({"v": 5, "t": "clear_namespace", "id": 1, "auth": "",
                                 "namespace": "AB" * 32})], expect="request")
    assert e.value.code == P.ErrorCode.MALFORMED
    # An admin clear names a namespace or all, never both or neither.
    for ns, everything in (("ef" * 32, True), ("", False)):
        with pytest.raises(P.ProtocolError) as e:
            P.decode(P.encode(P.AdminClearRequest(namespace=ns, all=everything)),
                     expect="request")
        assert e.value.code == P.ErrorCode.MALFORMED
    # A store type in a version-2 header is refused (a version-2 peer never sends one).
    with pytest.raises(P.ProtocolError) as e:
        P.decode([msgpack.packb({"v": 2, "t": "map_store", "id": 1, "auth": ""})],
                 expect="request")
    assert e.value.code == P.ErrorCode.BAD_VERSION
    with pytest.raises(P.ProtocolError) as e:
        P.decode([msgpack.packb({"v": 3, "t": "shm_commit", "id": 1, "auth": "", "arena_id": 1,
                                 "keys": [], "offsets": [], "reserve": []})],
                 expect="request")
    assert e.value.code == P.ErrorCode.BAD_VERSION
    # A version-2 header on a version-1 type is read too.
    back = P.decode([_header(**{**GOOD_GET, "v": 2})], expect="request")
    assert isinstance(back, P.GetRequest) and back.keys == ["a"]


@given(
    keys=st.lists(st.text(max_size=80), max_size=20),
    rid=st.integers(min_value=0, max_value=2**63 - 1),
    token=st.text(max_size=40),
)
@settings(max_examples=100, deadline=None)
def test_round_trip_property(keys: list[str], rid: int, token: str) -> None:
    frames = [bytes([i % 256]) * i for i in range(len(keys))]
    msg = P.SetRequest(request_id=rid, token=token, keys=keys, frames=frames)
    back = P.decode(P.encode(msg), expect="request")
    assert _normalise(back) == _normalise(msg)


def _header(**fields: object) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


GOOD_GET = {"v": 1, "t": "get", "id": 5, "auth": "", "keys": ["a"]}

MALFORMED: list[tuple[str, list[bytes], str]] = [
    ("empty message", [], P.ErrorCode.MALFORMED),
    ("not msgpack", [b"\xc1\xc1garbage"], P.ErrorCode.MALFORMED),
    ("truncated header", [_header(**GOOD_GET)[:-3]], P.ErrorCode.MALFORMED),
    ("trailing bytes", [_header(**GOOD_GET) + b"\x00"], P.ErrorCode.MALFORMED),
    ("header is a list", [msgpack.packb([1, "get", 5])], P.ErrorCode.MALFORMED),
    ("header is an int", [msgpack.packb(7)], P.ErrorCode.MALFORMED),
    ("empty header frame", [b""], P.ErrorCode.MALFORMED),
    ("no version", [_header(t="get", id=1, auth="", keys=[])], P.ErrorCode.BAD_VERSION),
    ("future version", [_header(**{**GOOD_GET, "v": P.PROTOCOL_VERSION + 1})], P.ErrorCode.BAD_VERSION),
    ("version as string", [_header(**{**GOOD_GET, "v": "1"})], P.ErrorCode.BAD_VERSION),
    ("version as float", [_header(**{**GOOD_GET, "v": 1.0})], P.ErrorCode.BAD_VERSION),
    ("version as bool", [_header(**{**GOOD_GET, "v": True})], P.ErrorCode.BAD_VERSION),
    (
        "shm type at version 1",
        [_header(v=1, t="shm_get", id=1, auth="", keys=[], offsets=[], capacities=[])],
        P.ErrorCode.BAD_VERSION,
    ),
    (
        "shm_set with fewer offsets than keys",
        [_header(v=2, t="shm_set", id=1, auth="", keys=["a", "b"], offsets=[0], lengths=[1, 1])],
        P.ErrorCode.MALFORMED,
    ),
    (
        "shm_get with a string offset",
        [_header(v=2, t="shm_get", id=1, auth="", keys=["a"], offsets=["0"], capacities=[1])],
        P.ErrorCode.MALFORMED,
    ),
    (
        "attach_shm without a size",
        [_header(v=2, t="attach_shm", id=1, auth="", name="x")],
        P.ErrorCode.MALFORMED,
    ),
    ("unknown type", [_header(**{**GOOD_GET, "t": "rm -rf"})], P.ErrorCode.UNKNOWN_TYPE),
    ("type not a string", [_header(**{**GOOD_GET, "t": 3})], P.ErrorCode.UNKNOWN_TYPE),
    ("keys is an int", [_header(**{**GOOD_GET, "keys": 3})], P.ErrorCode.MALFORMED),
    ("key is bytes", [_header(**{**GOOD_GET, "keys": [b"a"]})], P.ErrorCode.MALFORMED),
    ("id is a bool", [_header(**{**GOOD_GET, "id": True})], P.ErrorCode.MALFORMED),
    ("id is a float", [_header(**{**GOOD_GET, "id": 1.5})], P.ErrorCode.MALFORMED),
    ("token is missing", [_header(v=1, t="get", id=1, keys=[])], P.ErrorCode.MALFORMED),
    ("unknown field", [_header(**{**GOOD_GET, "extra": 1})], P.ErrorCode.MALFORMED),
    ("non-string map key", [msgpack.packb({1: 2})], P.ErrorCode.MALFORMED),
    ("payload on a get", [_header(**GOOD_GET), b"xx"], P.ErrorCode.MALFORMED),
    (
        "set with a missing frame",
        [_header(v=1, t="set", id=1, auth="", keys=["a", "b"]), b"x"],
        P.ErrorCode.MALFORMED,
    ),
    (
        "set with an extra frame",
        [_header(v=1, t="set", id=1, auth="", keys=["a"]), b"x", b"y"],
        P.ErrorCode.MALFORMED,
    ),
    (
        "get reply with a wrong length",
        [_header(v=1, t="get_ok", id=1, lengths=[3]), b"xy"],
        P.ErrorCode.MALFORMED,
    ),
    (
        "get reply missing a frame",
        [_header(v=1, t="get_ok", id=1, lengths=[3, 2]), b"xyz"],
        P.ErrorCode.MALFORMED,
    ),
    (
        "stats with a non-int value",
        [_header(v=1, t="stats_ok", id=1, stats={"a": "b"})],
        P.ErrorCode.MALFORMED,
    ),
]


@pytest.mark.parametrize("name,frames,code", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_frames_raise_protocol_errors(name: str, frames: list[bytes], code: str) -> None:
    with pytest.raises(P.ProtocolError) as e:
        P.decode(frames)
    assert e.value.code == code, name
    assert e.value.message


def test_error_keeps_the_request_id_when_readable() -> None:
    with pytest.raises(P.ProtocolError) as e:
        P.decode([_header(**{**GOOD_GET, "keys": 3})])
    assert e.value.request_id == 5
    assert P.peek_request_id(_header(**GOOD_GET)) == 5
    assert P.peek_request_id(b"\xc1") == 0


@given(st.binary(max_size=200), st.lists(st.binary(max_size=20), max_size=3))
@settings(max_examples=300, deadline=None)
def test_arbitrary_bytes_never_raise_anything_else(head: bytes, rest: list[bytes]) -> None:
    with contextlib.suppress(P.ProtocolError):
        P.decode([head, *rest])


@given(st.integers(min_value=0, max_value=60))
@settings(max_examples=61, deadline=None)
def test_every_truncation_of_a_valid_header_is_refused(cut: int) -> None:
    frames = P.encode(
        P.SetRequest(request_id=77, token="t", keys=["k1", "k2"], frames=[b"a", b"b"])
    )
    head = bytes(frames[0])
    if cut >= len(head):
        return
    with pytest.raises(P.ProtocolError):
        P.decode([head[:cut], *frames[1:]])
