"""Issue 47 in the engine: the cache hints (skip_cache_write, retention_seconds, priority)
through `Engine.add_request` / `generate` and through every HTTP API (OpenAI completions and
chat, SGLang's /generate), L3 admission in a real engine, and the invariant: greedy outputs with
any admission policy or hint equal those with caching off."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.engine import Engine
from tests.engine.test_server_api import EngineServer

PROMPT = ("The quick brown fox jumps over the lazy dog, and then the dog sleeps in the sun "
          "while the fox runs back to the forest.")
GREEDY = {"temperature": 0.0, "max_new_tokens": 6}


def make(tiny_model: Path, **kw: Any) -> Engine:
    kw.setdefault("enable_hierarchical_cache", True)
    kw.setdefault("hicache_storage_backend", "memory")
    if not kw["enable_hierarchical_cache"]:
        kw.pop("hicache_storage_backend")
    return Engine(model_path=str(tiny_model), page_size=4, max_total_tokens=2048,
                  chunked_prefill_size=64, dtype="float32", device="cpu",
                  hicache_synchronous=True, **kw)


def test_admission_and_hints_in_the_engine(tiny_model: Path) -> None:
    with make(tiny_model, disable_radix_cache=True, enable_hierarchical_cache=False) as off:
        want = off.generate([PROMPT], GREEDY)[0]["output_ids"]
    with make(tiny_model, hicache_storage_admission="reuse:2") as e:
        written = []
        for _ in range(3):
            assert e.generate([PROMPT], GREEDY)[0]["output_ids"] == want
            written.append(e.cache_stats()["storage_backup_pages"])
        # Sent once, then twice more: the prompt's pages reach L3 after the third.
        assert written[0] == written[1] == 0 and written[2] > 0
        assert e.cache_stats()["storage_declined_pages"] > 0
        other = PROMPT.replace("fox", "cat")
        out = e.generate([other], GREEDY, cache_hints={"skip_cache_write": True})
        s = e.cache_stats()
        assert s["skip_write_pages"] > 0 and s["storage_backup_pages"] == written[2]
        assert out[0]["output_ids"] == e.generate([other], GREEDY)[0]["output_ids"]
    with make(tiny_model, max_retention_seconds=60) as e:
        r = e.generate([PROMPT], GREEDY, cache_hints={"retention_seconds": 600, "priority": 3})
        assert r[0]["output_ids"] == want
        s = e.cache_stats()
        assert (s["retention_requests"], s["retention_clamped"]) == (1, 1)
        nodes = list(e.cache.tree.nodes())  # type: ignore[attr-defined]
        assert nodes and all(x.retain_until > 0 and x.priority == 3 for x in nodes)
        with pytest.raises(TypeError, match="skip_cache_write"):
            e.add_request(PROMPT, GREEDY, cache_hints={"skip_cache_write": "yes"})
        with pytest.raises(TypeError, match="priority"):
            e.add_request(PROMPT, GREEDY, cache_hints={"priority": 1.5})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    tmp = tmp_path_factory.mktemp("cache-hints")
    srv = EngineServer(tmp, ["--enable-hierarchical-cache", "--hicache-storage-backend", "memory",
                             "--hicache-synchronous", "--max-retention-seconds", "30",
                             "--request-log", str(tmp / "requests.jsonl")]).start()
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def stats(srv: EngineServer) -> dict[str, Any]:
    return httpx.get(srv.url + "/hicache/stats", timeout=30).json()


ROUTES = (
    ("/v1/completions", lambda text: {"prompt": text, "max_tokens": 3, "temperature": 0}),
    ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}],
                                           "max_tokens": 3, "temperature": 0}),
    ("/generate", lambda text: {"text": text,
                                "sampling_params": {"max_new_tokens": 3, "temperature": 0}}),
)


@pytest.mark.parametrize("route,body", ROUTES, ids=[r for r, _ in ROUTES])
def test_hints_through_each_api(server: EngineServer, route: str, body: Any) -> None:
    before = stats(server)
    text = f"{route} {PROMPT} {PROMPT}"
    r = httpx.post(server.url + route, json={**body(text), "skip_cache_write": True,
                                              "retention_seconds": 100, "priority": 2},
                   timeout=60)
    assert r.status_code == 200, r.text
    after = stats(server)
    assert after["skip_write_pages"] > before["skip_write_pages"]
    assert after["storage_backup_pages"] == before["storage_backup_pages"]
    assert after["retention_requests"] == before["retention_requests"] + 1
    assert after["retention_clamped"] == before["retention_clamped"] + 1  # 100 > 30
    log = [json.loads(x) for x in (server.tmp / "requests.jsonl").read_text().splitlines()]
    assert {"skip_cache_write": True, "retention_seconds": 100.0, "priority": 2}.items() <= \
        log[-1].items()
    for field, value in (("skip_cache_write", "yes"), ("retention_seconds", "long"),
                         ("priority", 1.5), ("retention_seconds", -1)):
        r = httpx.post(server.url + route, json={**body(PROMPT), field: value}, timeout=60)
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field
