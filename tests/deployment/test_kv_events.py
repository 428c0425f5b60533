"""KV events in vLLM's wire format: encoding (byte for byte what vLLM's msgspec structs write),
the PUB socket, the replay ROUTER, and rebuilding an instance's cached set per tier."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest
import zmq

from engine.kv_events import (
    END_SEQ,
    CachedBlocks,
    EventCollector,
    KVEventPublisher,
    KVEventsConfig,
    KVEventSubscriber,
    decode_batch,
    encode_batch,
)
from hicache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent
from hicache_client.errors import ConfigError
from tests.procs import free_port

try:  # vLLM's own struct definitions (vllm/distributed/kv_events.py, array_like variant)
    import msgspec
except ImportError:  # pragma: no cover
    msgspec = None

if msgspec is not None:
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                       tag=True):
        pass

    class VBlockStored(KVCacheEvent, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None

    class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None

    class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
        pass

    class KVEventBatch(EventBatch):
        events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


STORED = BlockStored(block_hashes=(11, -12), parent_hash=None, token_ids=(1, 2, 3, 4),
                     page_size=2, tier="device")
CHILD = BlockStored(block_hashes=(13,), parent_hash=-12, token_ids=(5, 6), page_size=2,
                    tier="host", extra_key="tenant-a")
REMOVED = BlockRemoved(block_hashes=(11,), tier="device")


def test_config_from_json_and_errors() -> None:
    cfg = KVEventsConfig.from_any('{"publisher": "zmq", "endpoint": "tcp://*:6000", '
                                  '"replay_endpoint": "tcp://*:6001", "topic": "kv", '
                                  '"buffer_steps": 7}')
    assert (cfg.publisher, cfg.endpoint, cfg.replay_endpoint, cfg.topic, cfg.buffer_steps) == (
        "zmq", "tcp://*:6000", "tcp://*:6001", "kv", 7)
    assert cfg.enabled
    assert not KVEventsConfig.from_any(None).enabled
    off = {"publisher": "zmq", "enable_kv_cache_events": False}
    assert not KVEventsConfig.from_any(off).enabled
    with pytest.raises(ConfigError, match="unknown keys"):
        KVEventsConfig.from_any('{"publisher": "zmq", "endpont": "tcp://*:1"}')
    with pytest.raises(ConfigError, match="unknown publisher"):
        KVEventsConfig.from_any({"publisher": "kafka"})
    with pytest.raises(ConfigError, match="buffer_steps"):
        KVEventsConfig.from_any({"buffer_steps": 0})
    with pytest.raises(ConfigError, match="not valid JSON"):
        KVEventsConfig.from_any("{publisher")


def test_encoding_is_vllm_array_like_msgpack() -> None:
    raw = msgpack.unpackb(encode_batch([STORED, CHILD, REMOVED, AllBlocksCleared(),
                                        AllBlocksCleared("host")], ts=12.5, dp_rank=0))
    assert raw == [12.5, [
        ["BlockStored", [11, -12], None, [1, 2, 3, 4], 2, None, "GPU", None, None, None],
        ["BlockStored", [13], -12, [5, 6], 2, None, "CPU", None, [["tenant-a"]], None],
        ["BlockRemoved", [11], "GPU", None],
        ["AllBlocksCleared"],
        ["AllBlocksCleared", "CPU"],
    ], 0]
    batch = decode_batch(3, encode_batch([STORED, CHILD, REMOVED, AllBlocksCleared("host")]))
    assert batch.seq == 3 and batch.dp_rank == 0
    assert batch.events == (STORED, CHILD, REMOVED, AllBlocksCleared("host"))


def test_bytes_equal_what_vllm_msgspec_structs_write() -> None:
    """vLLM's own struct definitions (array_like, tagged), encoded by msgspec, give the same
    bytes; and vLLM's decoder reads ours."""
    if msgspec is None:
        pytest.skip("msgspec is not installed")
    theirs = msgspec.msgpack.encode(KVEventBatch(ts=1.25, data_parallel_rank=0, events=[
        VBlockStored([11, -12], None, [1, 2, 3, 4], 2, None, "GPU", None),
        VBlockRemoved([11], "GPU"),
        VAllBlocksCleared(),
    ]))
    assert encode_batch([STORED, REMOVED, AllBlocksCleared()], ts=1.25) == theirs
    raw = encode_batch([CHILD, AllBlocksCleared("device")])
    got = msgspec.msgpack.Decoder(KVEventBatch).decode(raw)
    assert got.events[0].extra_keys == [("tenant-a",)] and got.events[0].medium == "CPU"
    assert isinstance(got.events[1], VAllBlocksCleared)


def _publisher(**kw: Any) -> tuple[KVEventPublisher, KVEventSubscriber]:
    pub_port, replay_port = free_port(), free_port()
    cfg = KVEventsConfig(publisher="zmq", endpoint=f"tcp://127.0.0.1:{pub_port}",
                         replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic="kv", **kw)
    sub = KVEventSubscriber(cfg.endpoint, cfg.replay_endpoint, topic="kv")  # binds; pub connects
    return KVEventPublisher(cfg), sub


def _wait_published(pub: KVEventPublisher, n: int) -> None:
    deadline = time.monotonic() + 30
    while pub.published < n:
        assert time.monotonic() < deadline, f"{pub.published} of {n} batches sent"
        time.sleep(0.01)


def _live(pub: KVEventPublisher, sub: KVEventSubscriber, events: list[CacheEvent]) -> Any:
    """Publish `events` until the subscriber receives one (the first sends may go out before
    the PUB socket's connection is up: PUB drops those); return what it received."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pub.publish(events)
        b = sub.recv(200)
        if b is not None:
            return b
    raise TimeoutError("no live batch arrived")


def test_publish_replay_and_rebuild() -> None:
    pub, sub = _publisher(buffer_steps=3)
    try:
        batches: list[list[CacheEvent]] = [[STORED], [CHILD], [REMOVED],
                                           [AllBlocksCleared("host")], [STORED]]
        for b in batches:
            pub.publish(b)
        pub.publish([])  # an empty step sends nothing and takes no sequence number
        _wait_published(pub, 5)
        # Only the last 3 batches are kept for replay.
        assert [b.seq for b in sub.replay(0)] == [2, 3, 4]
        replayed = sub.replay(3)
        assert [(b.seq, b.events) for b in replayed] == [(3, (AllBlocksCleared("host"),)),
                                                         (4, (STORED,))]
        # Live batches carry the next sequence numbers; a subscriber that missed some sees the
        # gap and replays it.
        live = _live(pub, sub, [CHILD])
        assert live.seq >= 5 and live.events == (CHILD,) and live.dp_rank == 0
        gap = sub.replay(live.seq - 2)
        assert [b.seq for b in gap] == [live.seq - 2, live.seq - 1, live.seq]
        assert pub.dropped == 0
    finally:
        pub.close()
        sub.close()


def test_cached_blocks_per_tier() -> None:
    view = CachedBlocks()
    view.apply(decode_batch(0, encode_batch([STORED, CHILD])))
    assert view.blocks == {"device": {11, -12}, "host": {13}, "storage": set()}
    view.apply(decode_batch(1, encode_batch([REMOVED])))
    assert view.blocks == {"device": {-12}, "host": {13}, "storage": set()}
    view.apply(decode_batch(2, encode_batch([AllBlocksCleared("host")])))
    assert view.blocks == {"device": {-12}, "host": set(), "storage": set()}
    view.apply(decode_batch(3, encode_batch([AllBlocksCleared()])))
    assert view.blocks == {"device": set(), "host": set(), "storage": set()}
    with pytest.raises(ValueError, match="out of order"):
        view.apply(decode_batch(7, encode_batch([STORED])))


def test_replay_ignores_malformed_requests_and_collector_batches() -> None:
    pub, sub = _publisher()
    try:
        ctx = zmq.Context.instance()
        bad = ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 0)
        assert sub.replay_endpoint is not None
        bad.connect(sub.replay_endpoint)
        bad.send_multipart([b"", b"xx"])  # not 8 bytes: ignored, the publisher keeps going
        bad.close(0)
        c = EventCollector()
        c(STORED)
        c(REMOVED)
        pub.publish(c.take())
        assert c.take() == []
        _wait_published(pub, 1)
        assert [(b.seq, b.events) for b in sub.replay(0)] == [(0, (STORED, REMOVED))]
        # The end marker is 8 bytes of -1.
        assert int.from_bytes(END_SEQ, "big", signed=True) == -1
    finally:
        pub.close()
        sub.close()
