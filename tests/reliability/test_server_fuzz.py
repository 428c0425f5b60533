"""Fuzzing the `hicache-server` protocol with a raw ZeroMQ DEALER socket: more than 10,000 random,
truncated, oversized and type-confused messages. The server answers each with a well-formed
reply (or, past ZeroMQ's hard size cap, drops the connection), stays up, keeps serving good
clients, and its memory stays bounded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_client.remote import protocol as P
from tests.procs import wait_until
from tests.storage_backends.hicache_server_proc import (
    HiCacheServerProc,
    codec,
    page_key,
    page_record,
)

MAX_FRAME = 64 * 1024
MAX_KEYS = 64
DRAWN = 10  # messages hypothesis draws per example; each is sent in VARIANTS forms
VARIANTS = 5
BATCH = DRAWN * VARIANTS
EXAMPLES = 210  # x BATCH messages = 10,500
CAPACITY = 4 << 20

REQUEST_TAGS = [c.TYPE for c in P.REQUEST_TYPES]
OTHER_TAGS = [c.TYPE for c in P.REPLY_TYPES] + ["", "GET", "drop", "get\x00"]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=12)
    | st.binary(max_size=24)
)
anything = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6) | st.integers(0, 9), inner, max_size=4),
    max_leaves=6,
)
hex_keys = st.lists(st.text("0123456789abcdef", min_size=1, max_size=64), max_size=MAX_KEYS + 4)


def _valid_header(tag: str, keys: list[str]) -> dict[str, Any]:
    header: dict[str, Any] = {"v": 1, "t": tag, "id": 1}
    schema = P.SCHEMAS.get(tag)
    if schema is None:
        return header
    for name, _tp in schema.header_fields:
        wire = {"request_id": "id", "token": "auth"}.get(name, name)
        header.setdefault(wire, {"token": "", "keys": keys}.get(name, 0))
    return header


@st.composite
def messages(draw: st.DrawFn) -> list[bytes]:
    """One message: frames of a near-valid request, mutated; or plain junk."""
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "junk", "msgpack"]))
    if kind == "junk":
        return draw(st.lists(st.binary(max_size=64), min_size=1, max_size=4))
    if kind == "msgpack":
        return [msgpack.packb(draw(anything), use_bin_type=True)]
    tag = draw(st.sampled_from(REQUEST_TAGS) | st.sampled_from(OTHER_TAGS))
    keys = draw(hex_keys)
    header = _valid_header(tag, keys)
    for field in draw(st.lists(st.sampled_from(sorted(header)), max_size=3, unique=True)):
        if draw(st.booleans()):
            del header[field]  # a missing field
        else:
            header[field] = draw(anything)  # a value of the wrong type (or, rarely, right)
    if draw(st.integers(0, 9)) == 0:
        header[draw(st.text(max_size=6))] = draw(anything)  # an unknown field
    if draw(st.integers(0, 9)) == 0:
        header["id"] = draw(st.integers(min_value=-(2**63), max_value=2**64 - 1))
    frame0 = msgpack.packb(header, use_bin_type=True)
    if draw(st.integers(0, 4)) == 0:
        frame0 = frame0[: draw(st.integers(0, max(0, len(frame0) - 1)))]  # truncated
    n_payload = len(keys) if tag == "set" and draw(st.booleans()) else draw(st.integers(0, 3))
    sizes = draw(
        st.lists(
            st.sampled_from([0, 1, 100, 4096, MAX_FRAME, MAX_FRAME + 1, MAX_FRAME * 3 // 2]),
            min_size=n_payload,
            max_size=n_payload,
        )
    )
    payload = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    if draw(st.integers(0, 19)) == 0:
        payload = [b""] * (MAX_KEYS + 2)  # too many frames
    if draw(st.integers(0, 19)) == 0:
        frame0 = b"\x00" * (MAX_FRAME + 10)  # an oversized header
    return [frame0, *payload]


def variants(frames: list[bytes]) -> list[list[bytes]]:
    """The message as drawn, its header cut short twice, a frame missing, a frame too many."""
    head = frames[0]
    return [
        frames,
        [head[: len(head) // 2], *frames[1:]],
        [head[:-1] if head else b"\xc1", *frames[1:]],
        frames[:-1] if len(frames) > 1 else [head, b"extra"],
        [*frames, head],
    ]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def read_reply(sock: zmq.Socket) -> P.Message:
    assert sock.poll(20000), "the server did not answer"
    frames = sock.recv_multipart()
    if len(frames) > 1 and frames[0] == b"":
        frames = frames[1:]
    return P.decode(frames, expect="reply")  # a well-formed reply, whatever we sent


@pytest.mark.slow
def test_fuzzed_frames_are_answered_and_the_server_stays_up(tmp_path: Path) -> None:
    srv = HiCacheServerProc(
        tmp_path,
        capacity=str(CAPACITY),
        args=["--max-frame-bytes", str(MAX_FRAME), "--max-keys", str(MAX_KEYS)],
    ).start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.url)
    good = srv.client()
    c = codec()
    counts = {"sent": 0, "errors": 0, "ok": 0}
    rss: list[int] = []
    try:
        assert isinstance(
            P.decode(_ask(sock, P.encode(P.PingRequest(request_id=1))), expect="reply"),
            P.PingReply,
        )
        rss.append(rss_kib(srv.proc.pid))  # type: ignore[union-attr]

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(drawn=st.lists(messages(), min_size=DRAWN, max_size=DRAWN))
        def fuzz(drawn: list[list[bytes]]) -> None:
            batch = [v for frames in drawn for v in variants(frames)]
            for frames in batch:
                sock.send_multipart(frames)
            for _ in batch:
                reply = read_reply(sock)
                counts["errors" if isinstance(reply, P.ErrorReply) else "ok"] += 1
            counts["sent"] += len(batch)
            if counts["sent"] % (BATCH * 100) == 0:
                rss.append(rss_kib(srv.proc.pid))  # type: ignore[union-attr]
                # A well-behaved client is served between the bursts.
                key = page_key("fuzz", counts["sent"])
                assert good.batch_set([key], [memoryview(page_record(c, "fuzz", 0))]) == [True]

        fuzz()
        assert counts["sent"] >= 10_000
        assert counts["errors"] > counts["sent"] // 2
        assert srv.alive()
        rss.append(rss_kib(srv.proc.pid))  # type: ignore[union-attr]

        # Past ZeroMQ's hard cap (2 x --max-frame-bytes) the connection is dropped, unanswered.
        for _ in range(3):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(srv.url)
            s.send_multipart([b"\x00" * (MAX_FRAME * 4)])
            s.close(0)
        wait_until(lambda: good.server_stats()["requests"] > 0, what="server answers")
        assert srv.alive()

        stats = good.server_stats()
        assert stats["bytes"] <= CAPACITY
        rec = page_record(c, "after", 0)
        assert good.batch_set([page_key("after", 0)], [memoryview(rec)]) == [True]
        out = memoryview(bytearray(c.record_bytes))
        assert good.batch_get([page_key("after", 0)], [out]) == [True]
        assert bytes(out) == bytes(rec)
        # Memory bounded: the second half of the run grew RSS by less than 32 MiB, and the whole
        # run by less than the store's capacity plus 64 MiB of allocator slack.
        assert rss[-1] - rss[len(rss) // 2] < 32 << 10, rss
        assert rss[-1] - rss[0] < (CAPACITY >> 10) + (64 << 10), rss
    finally:
        good.close()
        sock.close(0)
        ctx.term()
        srv.stop()
    assert "Traceback" not in srv.log()


def _ask(sock: zmq.Socket, frames: list[Any]) -> list[bytes]:
    sock.send_multipart(frames)
    assert sock.poll(20000)
    return sock.recv_multipart()
