"""A real engine publishes its KV events (`--kv-events-config`): a subscriber rebuilds what the
engine holds on each tier, exactly, and follows a cache flush."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx

from engine.kv_events import CachedBlocks, EventBatch, KVEventSubscriber
from tests.deployment.cluster import generate, l3_flags
from tests.engine.test_server_api import EngineServer
from tests.procs import free_port
from tests.storage_backends.hicache_server_proc import HiCacheServerProc

PAGE = 32
PROMPTS = [" ".join(f"Log {k}.{i}: valve {i % 9} of line {k} reads {i * k % 97} bar."
                    for i in range(24)) for k in range(6)]


class Listener:
    """A subscriber as a router runs one: a thread that keeps receiving (a ZeroMQ SUB socket
    sends its subscription to a new publisher only while it is being used)."""

    def __init__(self, sub: KVEventSubscriber) -> None:
        self.sub = sub
        self.batches: dict[int, EventBatch] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            b = self.sub.recv(20)
            if b is not None:
                self.batches[b.seq] = b

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)

    def rebuild(self, settle: float = 0.5, timeout: float = 60.0) -> CachedBlocks:
        """What the engine holds: the live batches, the ones missed (before the connection was
        up) replayed. Waits until the replay socket's answer stops growing (the publisher thread
        may still be sending the last step's batch)."""
        deadline = time.monotonic() + timeout
        last: list[EventBatch] = []
        while True:
            replayed = self.sub.replay(0)
            if last and [b.seq for b in replayed] == [b.seq for b in last]:
                break
            assert time.monotonic() < deadline, "the engine kept publishing"
            last = replayed
            time.sleep(settle)
        assert [b.seq for b in replayed] == list(range(len(replayed)))  # buffer kept them all
        live = dict(self.batches)
        assert live, "no batch arrived live"
        for b in replayed:  # the live copy of a batch is the replayed one
            if b.seq in live:
                assert live[b.seq] == b
        view = CachedBlocks()
        view.apply_all([live.get(b.seq, b) for b in replayed])
        return view


def test_engine_events_rebuild_every_tier(tmp_path: Path) -> None:
    store = HiCacheServerProc(tmp_path, capacity="256MiB").start()
    sub_port, replay_port = free_port(), free_port()
    cfg = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{sub_port}",
           "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "topic": "kv"}
    # The subscriber binds; the engine's PUB connects to it (vLLM's rule for a host address).
    sub = KVEventSubscriber(cfg["endpoint"], cfg["replay_endpoint"], topic="kv")
    listener = Listener(sub)
    flags = l3_flags(store, "--hicache-storage-prefetch-policy", "wait_complete",
                     "--max-total-tokens", "1024", "--hicache-ratio", "1.5",
                     "--kv-events-config", json.dumps(cfg))
    eng = EngineServer(tmp_path, flags, name="engine-events")
    client = store.client()
    try:
        eng.start().wait_ready()
        outs = [generate(eng.url, p, n=4) for p in PROMPTS]
        # The first prompt again: evicted from device and host by now, back from L3.
        again = generate(eng.url, PROMPTS[0], n=4)
        assert again["output_ids"] == outs[0]["output_ids"]
        s = eng.wait_transfers()
        assert s["storage_hit_tokens"] > 0 and s["evicted_tokens"] > 0
        view = listener.rebuild()
        usage = eng.stats()["usage"]
        assert len(view.blocks["device"]) * PAGE == usage["device_cached_tokens"] > 0
        assert len(view.blocks["host"]) * PAGE == usage["host_cached_tokens"] > 0
        assert len(view.blocks["storage"]) == int(client.server_stats()["pages"]) > 0
        # Every page the engine holds has been written through to L3.
        assert view.blocks["device"] | view.blocks["host"] <= view.blocks["storage"]
        # A flush drops L1 and L2 (AllBlocksCleared per tier); L3 keeps its pages.
        r = httpx.post(f"{eng.url}/flush_cache", timeout=60)
        assert r.status_code == 200, r.text
        after = listener.rebuild()
        assert after.blocks["device"] == after.blocks["host"] == set()
        assert after.blocks["storage"] == view.blocks["storage"]
        usage = eng.stats()["usage"]
        assert usage["device_cached_tokens"] == usage["host_cached_tokens"] == 0
    finally:
        client.close()
        eng.stop()
        store.stop()
        listener.close()
        sub.close()
    assert "Traceback" not in eng.proc.log()
