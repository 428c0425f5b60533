"""`hicache-admin lookup` against a real engine on a real `hicache-server`: what it reports for
a prompt (the server's pages, the engine's device / host prefix from its `/hicache/lookup`) is
what the next request reports as cached tokens: first from the device, then, after the
engine's cache is flushed, from L3, and below the prefetch floor not from L3 (the lookup says
why). And `pin --engine` pins the prompt's pages; `--engine-api-key` reaches an engine started
with `--api-key`."""

from __future__ import annotations

import json
from pathlib import Path

from tests.engine.test_server_api import EngineServer
from tests.engine.test_server_multi import L3_FLAGS, LONG_PROMPT, PAGE, generate
from tests.storage_backends.hicache_server_proc import HiCacheServerProc
from tests.storage_backends.test_hicache_admin import TOKEN, admin, admin_json


def test_lookup_agrees_with_the_next_requests_cached_tokens(tmp_path: Path) -> None:
    store = HiCacheServerProc(tmp_path, capacity="256MiB", args=["--admin-token", TOKEN]).start()
    flags = [*L3_FLAGS, "--hicache-storage-backend", "hicache",
             "--hicache-storage-backend-extra-config", json.dumps({"url": store.url})]
    eng = EngineServer(tmp_path, flags, name="engine-a").start()
    try:
        eng.wait_ready()
        first = generate(eng, LONG_PROMPT)
        n = first["meta_info"]["prompt_tokens"]
        reusable = (n - 1) // PAGE * PAGE
        eng.wait_transfers()
        look = admin_json(store.url, "lookup", "--text", LONG_PROMPT, "--engine", eng.url)
        assert look["prompt_tokens"] == n and look["page_size"] == PAGE
        assert look["server"]["reusable_tokens"] == reusable
        assert look["server"]["pages"] == n // PAGE  # the prompt's full pages are all there
        [e] = look["engines"]
        assert (e["device_tokens"], e["host_tokens"]) == (reusable, 0)
        assert e["namespace"] == look["namespace"]
        assert generate(eng, LONG_PROMPT)["meta_info"]["cached_tokens"] == e["device_tokens"]
        # The engine forgets the prompt; the server still holds it: the next request reads it
        # back from L3, exactly as much as the lookup says.
        eng.post("/flush_cache", {})
        look = admin_json(store.url, "lookup", "--text", LONG_PROMPT, "--engine", eng.url)
        [e] = look["engines"]
        assert (e["device_tokens"], e["host_tokens"]) == (0, 0)
        cached = generate(eng, LONG_PROMPT)["meta_info"]["cached_tokens"]
        assert cached == look["server"]["reusable_tokens"] == reusable
        # Tokenized here with the engine's model: the same prompt, the same pages.
        here = admin_json(store.url, "lookup", "--text", LONG_PROMPT, "--model", "hicache-demo",
                          "--namespace", look["namespace"], "--page-size", str(PAGE))
        assert here["prompt_tokens"] == n and here["server"] == look["server"]
        pin = admin_json(store.url, "pin", "--text", LONG_PROMPT, "--engine", eng.url)
        assert (pin["pinned"], pin["absent"]) == (n // PAGE, 0)
        text = admin(store.url, "lookup", "--text", LONG_PROMPT, "--engine", eng.url).stdout
        assert f"server: {n // PAGE} leading pages held" in text
        assert f"{n // PAGE} pinned); a request can reuse {reusable} tokens" in text
        assert f"engine {eng.url}: device {reusable} tokens, host 0 tokens; its next request " \
            f"reuses {reusable} tokens" in text
    finally:
        eng.stop()
        store.stop()
    assert "Traceback" not in eng.proc.log()


# About 130 tokens: under the 256-token floor below which an engine does not prefetch from L3
# unless its cost model expects loading to save 50 ms.
SHORT_PROMPT = " ".join(f"Buoy {i} rings at {i % 9} knots." for i in range(12))


def test_lookup_below_the_prefetch_floor_and_an_engine_with_an_api_key(tmp_path: Path) -> None:
    """A prompt whose pages the server holds but that the engine will not read back (too short
    to prefetch): the lookup says what the next request reuses, and why; an engine started with
    --api-key is reached with --engine-api-key (or env HICACHE_ENGINE_API_KEY)."""
    store = HiCacheServerProc(tmp_path, capacity="256MiB", args=["--admin-token", TOKEN]).start()
    flags = [*L3_FLAGS, "--hicache-storage-backend", "hicache",
             "--hicache-storage-backend-extra-config", json.dumps({"url": store.url})]
    eng = EngineServer(tmp_path, flags, name="engine-k", api_key="engkey").start()
    try:
        eng.wait_ready()
        n = generate(eng, SHORT_PROMPT)["meta_info"]["prompt_tokens"]
        assert n < 256
        reusable = (n - 1) // PAGE * PAGE
        eng.wait_transfers()
        eng.post("/flush_cache", {})
        r = admin(store.url, "lookup", "--text", SHORT_PROMPT, "--engine", eng.url)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
        assert "HTTP 401" in r.stderr and "pass --engine-api-key or set HICACHE_ENGINE_API_KEY" \
            in r.stderr
        look = admin_json(store.url, "lookup", "--text", SHORT_PROMPT, "--engine", eng.url,
                          "--engine-api-key", "engkey")
        assert look["server"]["reusable_tokens"] == reusable > 0
        [e] = look["engines"]
        assert (e["device_tokens"], e["host_tokens"]) == (0, 0)
        assert e["l3"]["gap_tokens"] == reusable and e["l3"]["floor_tokens"] == 256
        cached = generate(eng, SHORT_PROMPT)["meta_info"]["cached_tokens"]
        assert cached == e["reused_tokens"]
        if e["l3"]["prefetch"]:  # this machine's cost model expects loading to pay
            assert cached == reusable and e["why_not_server"] is None
        else:
            assert cached == 0
            assert e["why_not_server"] == (
                f"{reusable} tokens held by the server are not read: the {reusable}-token gap "
                "is under the 256-token prefetch floor and loading it is not expected to save "
                "50 ms (prefetch_threshold sets the floor)")
            text = admin(store.url, "lookup", "--text", SHORT_PROMPT, "--engine", eng.url,
                         "--engine-api-key", "engkey").stdout
            assert f"its next request reuses {reusable} tokens" in text  # now on the device
    finally:
        eng.stop()
        store.stop()
    assert "Traceback" not in eng.proc.log()
