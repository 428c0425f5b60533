"""Real engines publish their KV events (`--kv-events-config`): a subscriber per engine rebuilds
what that engine holds on each tier, exactly, and follows a cache flush."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from engine.kv_events import CachedBlocks, EventBatch, KVEventSubscriber
from hicache.events import BlockStored
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
        self.history: list[EventBatch] = []
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
        self.history = [live.get(b.seq, b) for b in replayed]
        view = CachedBlocks()
        view.apply_all(self.history)
        return view

    def ever_stored(self, tier: str) -> set[int]:
        """Every block announced on `tier` since the start (as of the last rebuild)."""
        return {h for b in self.history for ev in b.events
                if isinstance(ev, BlockStored) and ev.tier == tier for h in ev.block_hashes}


def events_config() -> dict[str, Any]:
    return {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{free_port()}",
            "replay_endpoint": f"tcp://127.0.0.1:{free_port()}", "topic": "kv"}


def test_engine_events_rebuild_every_tier(tmp_path: Path) -> None:
    """Two engines on one store, each publishing: each one's events rebuild what it holds."""
    store = HiCacheServerProc(tmp_path, capacity="256MiB").start()
    cfgs = [events_config(), events_config()]
    # The subscribers bind; each engine's PUB connects to its own (vLLM's rule for a host
    # address).
    subs = [KVEventSubscriber(c["endpoint"], c["replay_endpoint"], topic="kv") for c in cfgs]
    listeners = [Listener(sub) for sub in subs]
    engines = [
        EngineServer(tmp_path, l3_flags(store, "--hicache-storage-prefetch-policy",
                                        "wait_complete", "--max-total-tokens", "1024",
                                        "--hicache-ratio", "1.5", "--kv-events-config",
                                        json.dumps(c)), name=f"engine-events-{i}")
        for i, c in enumerate(cfgs)
    ]
    client = store.client()
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready()
        a, b = engines
        outs = [generate(a.url, p, n=4) for p in PROMPTS[:4]]
        # The first prompt again: evicted from A's device and host by now, back from L3.
        again = generate(a.url, PROMPTS[0], n=4)
        assert again["output_ids"] == outs[0]["output_ids"]
        a.wait_transfers()
        # B serves two prompts A already stored and two new ones.
        for p in PROMPTS[2:]:
            generate(b.url, p, n=4)
        views = []
        for e, listener in zip(engines, listeners):
            s = e.wait_transfers()
            assert s["storage_hit_tokens"] > 0 and s["evicted_tokens"] > 0
            view = listener.rebuild()
            usage = e.stats()["usage"]
            assert len(view.blocks["device"]) * PAGE == usage["device_cached_tokens"] > 0
            assert len(view.blocks["host"]) * PAGE == usage["host_cached_tokens"] > 0
            # Every page the engine holds has been written through to L3.
            assert view.blocks["device"] | view.blocks["host"] <= view.blocks["storage"]
            views.append(view)
        # The store holds exactly the pages the two engines announced on the storage tier (each
        # announces its own writes; B wrote only what A had not).
        stored = views[0].blocks["storage"] | views[1].blocks["storage"]
        assert len(stored) == int(client.server_stats()["pages"])
        # The same tokens have the same block hashes on both engines: what B prefetched to its
        # host tier from L3 is what A announced there.
        fetched = listeners[1].ever_stored("host") & views[0].blocks["storage"]
        assert len(fetched) * PAGE == b.stats()["prefetch_tokens"] > 0
        # A flush drops A's L1 and L2 (AllBlocksCleared per tier); L3 keeps its pages.
        r = httpx.post(f"{a.url}/flush_cache", timeout=60)
        assert r.status_code == 200, r.text
        after = listeners[0].rebuild()
        assert after.blocks["device"] == after.blocks["host"] == set()
        assert after.blocks["storage"] == views[0].blocks["storage"]
        usage = a.stats()["usage"]
        assert usage["device_cached_tokens"] == usage["host_cached_tokens"] == 0
    finally:
        client.close()
        for e in engines:
            e.stop()
        store.stop()
        for listener, sub in zip(listeners, subs):
            listener.close()
            sub.close()
    for e in engines:
        assert "Traceback" not in e.proc.log()
