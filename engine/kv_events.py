"""KV events over ZeroMQ in vLLM's wire format, so that routers (smg, Dynamo, llm-d) can see which
prefixes every engine holds and on which tier.

`--kv-events-config` takes the JSON object of vLLM's and SGLang's `KVEventsConfig`:

```json
{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
 "topic": "kv-events", "buffer_steps": 10000}
```

Wire format (vLLM's `ZmqEventPublisher`, `array_like` msgpack structs):

- PUB socket: one multipart message per batch, `[topic, seq, payload]`; `seq` is the batch's
  sequence number as 8 bytes big-endian (0, 1, 2, ... per publisher), `payload` the msgpack of
  `[ts, [event, ...], dp_rank]` (an `EventBatch`; `ts` in seconds since the epoch).
- Events are tagged arrays: `["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name, extra_keys, group_idx]`, `["BlockRemoved",
  block_hashes, medium, group_idx]`, `["AllBlocksCleared"]`. `lora_id`, `lora_name` and
  `group_idx` are nil; `extra_keys` is nil, or `[[extra_key]]` per block for pages cached under
  a request's `extra_key`. Block hashes are `hicache.events.block_hash` (int64).
- `medium` names the tier: `MEDIUMS` below (device -> "GPU", host -> "CPU", storage ->
  "STORAGE"). vLLM's `AllBlocksCleared` has no field and clears every tier; a clear of one tier
  (the engine's cache flush drops L1 and L2, never L3) adds that tier's medium as a trailing
  element, `["AllBlocksCleared", "GPU"]`, which a vLLM decoder ignores (it then forgets every
  tier: it knows less than it could, never more than is true).
- Replay: a ROUTER socket on `replay_endpoint`. A client (DEALER, or REQ) sends
  `[b"", start_seq]` (8 bytes big-endian); it gets every buffered batch with `seq >= start_seq`
  as `[b"", seq, payload]`, then the end marker `[b"", (-1 as 8 bytes signed), b""]`. The last
  `buffer_steps` batches are kept.

The endpoints follow vLLM's rule: an address with `*` (or `::`, `ipc://`, `inproc://`) is bound,
any other is connected to (the subscriber binds). The replay endpoint is always bound.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import msgpack
import zmq

from hicache.events import TIERS, AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, Tier
from hicache_client.errors import ConfigError

logger = logging.getLogger(__name__)

# The tier of a page as vLLM's `medium` ("GPU" is vLLM's MEDIUM_GPU, "CPU" what its CPU offload
# connector reports; L3 has no vLLM name).
MEDIUMS: dict[Tier, str] = {"device": "GPU", "host": "CPU", "storage": "STORAGE"}
TIER_OF_MEDIUM: dict[str, Tier] = {m: t for t, m in MEDIUMS.items()}
END_SEQ = (-1).to_bytes(8, "big", signed=True)
PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's / SGLang's KV-events settings (unknown keys are an error)."""

    publisher: str = "null"  # "zmq" publishes; "null" (the default) does not
    endpoint: str = "tcp://*:5557"  # PUB address: bound if it holds "*", else connected to
    replay_endpoint: str | None = None  # ROUTER address for replays (bound); None = no replay
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # PUB high-water mark (messages)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""  # first frame of every message
    enable_kv_cache_events: bool = True  # vLLM's switch; False publishes nothing

    def __post_init__(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise ConfigError(f"kv_events_config: unknown publisher {self.publisher!r}; "
                              f"known: {', '.join(PUBLISHERS)}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"kv_events_config: {name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ConfigError(f"kv_events_config: endpoint must be a ZeroMQ address, got "
                              f"{self.endpoint!r}")
        if self.replay_endpoint is not None and "://" not in str(self.replay_endpoint):
            raise ConfigError(f"kv_events_config: replay_endpoint must be a ZeroMQ address, got "
                              f"{self.replay_endpoint!r}")

    @property
    def enabled(self) -> bool:
        return self.publisher == "zmq" and self.enable_kv_cache_events

    @classmethod
    def from_any(cls, value: str | Mapping[str, Any] | None) -> KVEventsConfig:
        """From the flag's JSON text (or a dict); None or "" is the disabled default."""
        import json

        if value is None or value == "":
            return cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"kv_events_config is not valid JSON: {e}") from e
        if not isinstance(value, Mapping):
            raise ConfigError("kv_events_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"kv_events_config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**dict(value))


# ---- encoding ---------------------------------------------------------------------------------


def encode_event(ev: CacheEvent) -> list[Any]:
    """One event as vLLM's tagged array (field for field what msgspec writes for vLLM's
    `array_like` structs, trailing defaults included)."""
    if isinstance(ev, BlockStored):
        # vLLM's extra_keys: one tuple per block (here the request's extra_key / cache salt).
        extra = None if ev.extra_key is None else [[ev.extra_key] for _ in ev.block_hashes]
        return ["BlockStored", list(ev.block_hashes), ev.parent_hash, list(ev.token_ids),
                ev.page_size, None, MEDIUMS[ev.tier], None, extra, None]
    if isinstance(ev, BlockRemoved):
        return ["BlockRemoved", list(ev.block_hashes), MEDIUMS[ev.tier], None]
    if isinstance(ev, AllBlocksCleared):
        # vLLM's AllBlocksCleared has no field; a clear of one tier adds its medium.
        return ["AllBlocksCleared"] if ev.tier is None else ["AllBlocksCleared", MEDIUMS[ev.tier]]
    raise TypeError(f"not a cache event: {type(ev).__name__}")


def encode_batch(events: Sequence[CacheEvent], ts: float | None = None,
                 dp_rank: int = 0) -> bytes:
    """An `EventBatch` payload: msgpack of `[ts, [event, ...], dp_rank]`."""
    ts = time.time() if ts is None else ts
    return bytes(msgpack.packb([ts, [encode_event(e) for e in events], dp_rank],
                               use_bin_type=True))


def decode_event(raw: Sequence[Any]) -> CacheEvent:
    """The inverse of `encode_event` (for subscribers and tests)."""
    tag = raw[0]
    if tag == "BlockStored":
        hashes, parent, tokens, size, _lora_id, medium = raw[1:7]
        extra = raw[8] if len(raw) > 8 else None
        return BlockStored(
            block_hashes=tuple(hashes), parent_hash=parent, token_ids=tuple(tokens),
            page_size=int(size), tier=TIER_OF_MEDIUM[medium],
            extra_key=extra[0][0] if extra else None,
        )
    if tag == "BlockRemoved":
        return BlockRemoved(block_hashes=tuple(raw[1]), tier=TIER_OF_MEDIUM[raw[2]])
    if tag == "AllBlocksCleared":
        return AllBlocksCleared(tier=TIER_OF_MEDIUM[raw[1]] if len(raw) > 1 else None)
    raise ValueError(f"unknown event tag {tag!r}")


@dataclass(frozen=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[CacheEvent, ...]
    dp_rank: int | None


def decode_batch(seq: int, payload: bytes) -> EventBatch:
    raw = msgpack.unpackb(payload, raw=False)
    return EventBatch(seq=seq, ts=float(raw[0]), events=tuple(decode_event(e) for e in raw[1]),
                      dp_rank=raw[2] if len(raw) > 2 else None)


# ---- the publisher ----------------------------------------------------------------------------


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """PUB + replay ROUTER on a thread of their own; `publish()` only queues a batch.

    `publish()` never blocks the caller: when `max_queue_size` batches are waiting, the batch is
    dropped, counted in `dropped` and logged (a subscriber sees the sequence gap and resyncs).
    """

    def __init__(self, config: KVEventsConfig, dp_rank: int = 0) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.dropped = 0
        self.published = 0
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ConfigError(f"kv events: cannot open {config.endpoint} / "
                              f"{config.replay_endpoint}: {e}") from e
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV events on %s (replay %s, topic %r)", config.endpoint,
                    config.replay_endpoint, config.topic)

    def publish(self, events: Sequence[CacheEvent]) -> None:
        """Queue one batch (nothing is sent for an empty one)."""
        if not events:
            return
        if not self._running:
            raise RuntimeError("the KV event publisher is closed")
        payload = encode_batch(events, dp_rank=self.dp_rank)
        try:
            self._queue.put_nowait(payload)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("KV event queue full: %d batches dropped", self.dropped)

    def _loop(self) -> None:
        seq = 0
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    try:
                        self._serve_replay()
                    except zmq.ZMQError as e:
                        logger.warning("KV event replay failed: %s", e)
            try:
                payload = self._queue.get(timeout=0.02)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if payload is None:
                return
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as e:
                logger.warning("KV event publish failed: %s", e)
            self._buffer.append((seq, payload))
            self.published += 1
            seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a malformed KV event replay request (%d frames)",
                           len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to `timeout` seconds), then close the sockets."""
        if not self._running:
            return
        self._running = False
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()


class EventCollector:
    """The cache's `EventSink` in the scheduler process: events of one step, then `take()`."""

    def __init__(self) -> None:
        self.events: list[CacheEvent] = []

    def __call__(self, event: CacheEvent) -> None:
        self.events.append(event)

    def take(self) -> list[CacheEvent]:
        out, self.events = self.events, []
        return out


# ---- the subscriber side ----------------------------------------------------------------------


class KVEventSubscriber:
    """A SUB socket (bound or connected as `endpoint` says, the mirror of the publisher's rule)
    and an optional replay client. For routers written in Python, and for the tests.

    NOTE: keep calling `recv()` (a receiving thread): a bound SUB socket hands its subscription
    to a publisher that connects only when the socket is next used, and until then that
    publisher drops every batch (they can be replayed)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 bind: bool | None = None) -> None:
        self._ctx = zmq.Context()
        self.sub = self._ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        if bind if bind is not None else not _binds(endpoint):
            self.sub.bind(endpoint)
        else:
            self.sub.connect(endpoint.replace("*", "127.0.0.1"))
        self.replay_endpoint = replay_endpoint

    def recv(self, timeout_ms: int) -> EventBatch | None:
        """The next batch, or None after `timeout_ms` with nothing."""
        if not self.sub.poll(timeout_ms):
            return None
        _topic, seq, payload = self.sub.recv_multipart()
        return decode_batch(int.from_bytes(seq, "big"), payload)

    def replay(self, start_seq: int, timeout_ms: int = 5000) -> list[EventBatch]:
        """Every buffered batch from `start_seq` on, asked of the replay socket."""
        if self.replay_endpoint is None:
            raise ValueError("no replay endpoint")
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.replay_endpoint.replace("*", "127.0.0.1"))
        try:
            s.send_multipart((b"", start_seq.to_bytes(8, "big")))
            out = []
            while True:
                if not s.poll(timeout_ms):
                    raise TimeoutError(f"no replay answer from {self.replay_endpoint}")
                _, seq, payload = s.recv_multipart()
                if seq == END_SEQ:
                    return out
                out.append(decode_batch(int.from_bytes(seq, "big"), payload))
        finally:
            s.close(0)

    def close(self) -> None:
        self.sub.close(0)
        self._ctx.term()


class CachedBlocks:
    """What one instance holds, per tier, rebuilt from its events in sequence order."""

    def __init__(self) -> None:
        self.blocks: dict[Tier, set[int]] = {t: set() for t in TIERS}
        self.next_seq = 0

    def apply(self, batch: EventBatch) -> None:
        if batch.seq != self.next_seq:
            raise ValueError(f"batch {batch.seq} out of order (expected {self.next_seq})")
        self.next_seq += 1
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.blocks[ev.tier].update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.blocks[ev.tier].difference_update(ev.block_hashes)
            else:
                for t in TIERS if ev.tier is None else (ev.tier,):
                    self.blocks[t].clear()

    def apply_all(self, batches: Iterable[EventBatch]) -> None:
        for b in sorted(batches, key=lambda b: b.seq):
            if b.seq >= self.next_seq:
                self.apply(b)
