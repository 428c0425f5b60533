"""Three `hicache-engine`s on one `hicache-server` behind the SGLang model gateway (`smg`):
requests succeed through it, a prefix computed on one engine is an L3 hit on another, and killing
an engine loses no request once the gateway's health check has dropped it."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.deployment.cluster import (
    LONG_PROMPT,
    PAGE,
    Gateway,
    l3_flags,
    post_with_retries,
    start_engines,
    wait_store_pages,
)
from tests.storage_backends.hicache_server_proc import HiCacheServerProc

pytestmark = pytest.mark.slow

# NOTE: smg 1.13 adds a `model` field to the /generate bodies it forwards, which the engine's
# strict request bodies refuse (400 unknown_field) unless told to drop unknown fields.
SMALL = ["--max-total-tokens", "4096", "--max-running-requests", "8"]
# wait_complete rather than the default `timeout`: the exact L3 hit counts below must not depend
# on how loaded the machine is (`timeout` starts with what arrived within its budget).
FLAGS = [*SMALL, "--hicache-storage-prefetch-policy", "wait_complete"]
GATEWAY_FLAGS = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                 "--health-check-timeout-secs", "1"]


def gen(text: str, n: int = 6) -> dict[str, object]:
    return {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                              "ignore_eos": True}}


def test_three_engines_behind_smg_share_l3_and_survive_a_kill(tmp_path: Path) -> None:
    store = HiCacheServerProc(tmp_path, capacity="256MiB").start()
    engines = []
    gw = None
    try:
        engines = start_engines(tmp_path, 3, l3_flags(store, *FLAGS))
        gw = Gateway(tmp_path, [e.url for e in engines], "round_robin", GATEWAY_FLAGS)
        gw.start(3)
        assert gw.healthy_workers() == sorted(e.url for e in engines)

        # 1. Requests succeed through the gateway: OpenAI chat and SGLang /generate.
        chat = post_with_retries(gw.url, "/v1/chat/completions", {
            "model": "hicache-demo", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Which pier floods first?"}]}, tries=1)
        assert chat.status == 200 and chat.body["choices"][0]["message"]["content"]
        for i in range(3):
            r = post_with_retries(gw.url, "/generate", gen(f"Short request {i}."), tries=1)
            assert r.status == 200 and len(r.body["output_ids"]) == 6

        # 2. The long prompt goes to one engine; its write-through fills the store by itself.
        first = post_with_retries(gw.url, "/generate", gen(LONG_PROMPT), tries=1)
        assert first.status == 200 and first.body["meta_info"]["cached_tokens"] == 0
        prompt_tokens = first.body["meta_info"]["prompt_tokens"]
        computed = [e for e in engines
                    if e.stats()["usage"]["device_cached_tokens"] >= prompt_tokens // PAGE * PAGE]
        assert len(computed) == 1
        full_pages = (prompt_tokens + 6 - 1) // PAGE
        assert wait_store_pages(store, full_pages) >= full_pages
        # Round robin sends the next two copies to the two other engines: both take the prefix
        # from L3 and answer the same tokens.
        for _ in range(2):
            again = post_with_retries(gw.url, "/generate", gen(LONG_PROMPT), tries=1)
            assert again.status == 200
            assert again.body["output_ids"] == first.body["output_ids"]
        stats = {e.url: e.stats() for e in engines}
        others = [e for e in engines if e is not computed[0]]
        hits = {e.url: stats[e.url]["storage_hit_tokens"] for e in others}
        assert all(h == (prompt_tokens - 1) // PAGE * PAGE for h in hits.values()), hits
        assert stats[computed[0].url]["storage_hit_tokens"] == 0

        # 3. Kill one engine in the middle of a stream of requests. The client retries on
        # connection errors and 5xx; no request is lost.
        victim = others[0]
        prompts = [f"Request {i}: the ferry timetable for dock {i % 5}." for i in range(24)]

        def one(text: str) -> tuple[int, int]:
            r = post_with_retries(gw.url, "/generate", gen(text))
            return r.status, r.tries

        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(one, p) for p in prompts[:12]]
            while sum(f.done() for f in futures) < 3:
                time.sleep(0.05)
            victim.proc.kill(signal.SIGKILL)
            futures += [pool.submit(one, p) for p in prompts[12:]]
            results = [f.result() for f in futures]
        assert [s for s, _ in results] == [200] * len(prompts)
        # The gateway's health check drops the dead engine ...
        deadline = time.monotonic() + 60
        while victim.url in gw.healthy_workers():
            assert time.monotonic() < deadline, gw.workers()
            time.sleep(0.2)
        # ... after which every request succeeds at the first try.
        after = [post_with_retries(gw.url, "/generate", gen(f"After {i}."), tries=1)
                 for i in range(6)]
        assert [(a.status, a.tries) for a in after] == [(200, 1)] * 6
        alive = [e for e in engines if e is not victim]
        assert sum(e.stats()["scheduler"]["finished"] for e in alive) >= 6
    finally:
        if gw is not None:
            gw.stop()
        for e in engines:
            e.stop()
        store.stop()
