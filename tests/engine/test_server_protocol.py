"""The front end <-> scheduler protocol (every message round-trips through msgpack, malformed
frames are rejected) and the CLI's mapping of flags onto `EngineArgs`."""

from __future__ import annotations

import dataclasses
import json

import msgpack
import pytest

from engine.args import EngineArgs
from engine.cli import build_parser, field_comments, parse_args
from engine.server import protocol as P

SAMPLES: list[object] = [
    P.GenerateReq(rid="r1", input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4,
                                                                  "stop": ["\n"]},
                  extra_key="tenant"),
    P.GenerateReq(rid="r2", input_ids=[], sampling_params={}),
    P.AbortReq(rid="r1"),
    P.ControlReq(cid="c", op="attach_storage",
                 payload={"backend": "file", "extra_config": {"path": "/x", "n": 1.5}}),
    P.ShutdownReq(reason="bye"),
    P.Ready(pid=7, model_path="/m", model_id="id", context_length=4096, max_total_tokens=8192,
            vocab_size=1024, page_size=32, storage_backend=None, eos_token_ids=[0, 4]),
    P.ReqOut(rid="r1", new_token_ids=[5], finished=False, finish_reason=None, prompt_tokens=3,
             completion_tokens=1, cached_tokens=0),
    P.BatchOut(outputs=[
        P.ReqOut(rid="a", new_token_ids=[1, 2], finished=True,
                 finish_reason={"type": "stop", "matched": "\n"}, prompt_tokens=9,
                 completion_tokens=2, cached_tokens=8),
        P.ReqOut(rid="b", new_token_ids=[], finished=True,
                 finish_reason={"type": "abort", "message": "x"}, prompt_tokens=1,
                 completion_tokens=0, cached_tokens=0),
    ]),
    P.BatchOut(outputs=[]),
    P.ReqError(rid="r1", message="too long", status=400),
    P.ControlResp(cid="c", status=409, payload={"a": [1, 2]}, error="busy"),
]


def test_every_message_type_has_a_sample() -> None:
    assert {type(m) for m in SAMPLES} == set(P.MESSAGE_TYPES)
    assert all(dataclasses.is_dataclass(t) for t in P.MESSAGE_TYPES)
    assert len({t.__name__ for t in P.MESSAGE_TYPES}) == len(P.MESSAGE_TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: object) -> None:
    frame = P.encode(msg)
    assert isinstance(frame, bytes)
    assert b"pickle" not in frame and not frame.startswith(b"\x80")  # msgpack, never pickle
    back = P.decode(frame)
    assert type(back) is type(msg)
    assert back == msg


@pytest.mark.parametrize("frame", [
    b"",
    b"\xc1",  # never used in msgpack
    msgpack.packb([P.VERSION, "NoSuchMessage", []]),
    msgpack.packb([P.VERSION + 1, "AbortReq", ["r"]]),
    msgpack.packb([P.VERSION, "AbortReq", ["r", "extra"]]),
    msgpack.packb([P.VERSION, "BatchOut", ["not a list"]]),
    msgpack.packb({"rid": "r"}),
    msgpack.packb([P.VERSION, "AbortReq", ["r"]]) + b"trailing",
])
def test_malformed_frames_rejected(frame: bytes) -> None:
    with pytest.raises(P.ProtocolError):
        P.decode(frame)


def test_non_messages_are_not_encoded() -> None:
    @dataclasses.dataclass
    class AbortReq:  # same name, not the protocol's class
        rid: str

    with pytest.raises(P.ProtocolError):
        P.encode(AbortReq(rid="x"))
    with pytest.raises(P.ProtocolError):
        P.encode({"rid": "x"})


def test_cli_flags_map_onto_engine_args(tmp_path: object) -> None:
    args, level = parse_args([
        "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
        "--hicache-storage-backend-extra-config", json.dumps({"path": "/p"}),
        "--page-size", "16", "--hicache-ratio", "3.5", "--request-log", "/tmp/req.jsonl",
        "--api-key", "k", "--port", "31000", "--log-level", "warning",
    ])
    assert level == "warning"
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "file"
    assert args.storage_extra_config() == {"path": "/p"}
    assert args.page_size == 16 and args.hicache_ratio == 3.5
    assert args.request_log == "/tmp/req.jsonl"
    assert (args.api_key, args.port, args.host) == ("k", 31000, "127.0.0.1")
    defaults, _ = parse_args([])
    assert defaults == EngineArgs()


def test_cli_help_text_comes_from_the_field_comments() -> None:
    comments = field_comments()
    assert comments["page_size"] == "Tokens per KV page (one L3 record per page)."
    helps = {a.dest: a.help for a in build_parser()._actions}
    for name in EngineArgs.field_names():
        assert helps.get(name), name
    assert helps["page_size"] == comments["page_size"]


def test_cli_rejects_bad_values() -> None:
    for argv in (["--dtype", "int8"], ["--page-size", "x"],
                 ["--hicache-storage-backend", "file"],  # needs --enable-hierarchical-cache
                 ["--hicache-storage-backend-extra-config", "{not json"]):
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
        assert e.value.code == 2


def test_docs_list_every_flag_and_endpoint() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    for name in EngineArgs.field_names():
        assert f"`--{name.replace('_', '-')}`" in doc, name
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/generate",
                 "/health", "/metrics", "/flush_cache", "/hicache/stats",
                 "/hicache/storage-backend", "/hicache/storage-backend/clear"):
        assert path in doc, path
