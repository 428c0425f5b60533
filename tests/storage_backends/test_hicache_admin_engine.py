"""`hicache-admin lookup` against a real engine on a real `hicache-server`: what it reports for
a prompt (the server's pages, the engine's device / host prefix from its `/hicache/lookup`) is
what the next request reports as cached tokens: first from the device, then, after the
engine's cache is flushed, from L3. And `pin --engine` pins the prompt's pages."""

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
        assert f"engine {eng.url}: device {reusable} tokens, host 0 tokens" in text
    finally:
        eng.stop()
        store.stop()
    assert "Traceback" not in eng.proc.log()
