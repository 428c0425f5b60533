"""The engine's HTTP API under bad input and load, on a real `hicache-engine` (front end and
scheduler processes) serving the tiny model with host and `hicache-server` L3 tiers:

- `--api-key`: every endpoint but /health refuses a missing or wrong Bearer key;
- generated requests (hypothesis; near-valid bodies with missing, unknown and type-confused
  fields, broken JSON): every answer is a well-formed 2xx or 4xx, never a 5xx or a hang;
- the engine's `hicache-server` SIGKILLed and restarted: requests complete with the outputs of
  caching off, /hicache/stats counts the failures, storage hits resume;
- 64 concurrent clients for 60 s: every request completes, and once idle and flushed the pools
  are back to their baseline (no leaked page).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.procs import ManagedProcess, free_port, wait_until
from tests.reliability.conftest import SAMPLING as GREEDY
from tests.reliability.conftest import Reference, make_prompts
from tests.storage_backends.hicache_server_proc import HiCacheServerProc

REPO = Path(__file__).resolve().parents[2]
API_KEY = "rel-key-5b1d0c"
READY = "hicache-engine ready on http://"
LOAD_SECONDS = 60
LOAD_CLIENTS = 64


class Server:
    """`hicache-engine` (tiny model, CPU, 4-token pages) with L2 and L3 on a `hicache-server`."""

    def __init__(self, tmp: Path, model: Path, store: HiCacheServerProc) -> None:
        self.port = free_port()
        self.store = store
        extra = {"url": store.url, "timeout_ms": 500, "prefetch_threshold": 0,
                 "load_back_threshold": 0}
        argv = [
            sys.executable, "-m", "engine", "--host", "127.0.0.1", "--port", str(self.port),
            "--model-path", str(model), "--device", "cpu", "--dtype", "float32",
            "--page-size", "4", "--max-total-tokens", "8192", "--api-key", API_KEY,
            "--enable-hierarchical-cache", "--hicache-storage-backend", "hicache",
            "--hicache-storage-backend-extra-config", json.dumps(extra),
            "--hicache-storage-prefetch-policy", "wait_complete",
        ]
        self.proc = ManagedProcess(argv, tmp / "engine.log", cwd=REPO)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> Server:
        self.proc.start()
        deadline = time.monotonic() + timeout
        while READY not in self.proc.log():
            if not self.proc.alive():
                raise RuntimeError(f"engine exited:\n{self.proc.log()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine not ready:\n{self.proc.log()[-4000:]}")
            time.sleep(0.1)
        return self

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout,
                            headers={"Authorization": f"Bearer {API_KEY}"})

    def stats(self) -> dict[str, Any]:
        with self.client() as c:
            r = c.get("/hicache/stats")
            assert r.status_code == 200, r.text
            return dict(r.json())

    def idle_and_flushed(self) -> dict[str, Any]:
        """Wait until no request runs and no transfer is pending, flush L1/L2; the stats."""

        def idle() -> bool:
            s = self.stats()
            return (s["scheduler"]["running"] == 0 and s["scheduler"]["waiting"] == 0
                    and s["usage"]["pending_transfers"] == 0
                    and s["usage"]["host_inflight_pages"] == 0)

        wait_until(idle, timeout=120, interval=0.2, what="engine idle")
        with self.client() as c:
            r = c.post("/flush_cache")
            assert r.status_code == 200, r.text
        return self.stats()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("http")
    store = HiCacheServerProc(tmp / "store").start()
    srv = Server(tmp, tiny_model, store)
    try:
        yield srv.start()
    finally:
        srv.proc.stop(timeout=60)
        store.stop()
        log = srv.proc.log()
        assert "Traceback" not in log, log[-4000:]


# ---- --api-key ------------------------------------------------------------------------------

ROUTES = [
    ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    ("POST", "/generate"), ("GET", "/get_model_info"), ("POST", "/flush_cache"),
    ("GET", "/hicache/stats"), ("GET", "/hicache/storage-backend"),
    ("PUT", "/hicache/storage-backend"), ("DELETE", "/hicache/storage-backend"),
    ("POST", "/hicache/storage-backend/clear"), ("GET", "/no/such/route"),
]


def test_api_key_refuses_requests_without_it(server: Server) -> None:
    bad_headers: list[dict[str, str]] = [
        {}, {"Authorization": ""}, {"Authorization": "Bearer"}, {"Authorization": "Bearer x y"},
        {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"},
        {"Authorization": f"Bearer {API_KEY}x"}, {"Authorization": f"Bearer {API_KEY[:-1]}"},
        {"Authorization": API_KEY}, {"X-API-Key": API_KEY},
    ]
    body = {"prompt": "hello", "max_tokens": 2}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for method, path in ROUTES:
            for h in bad_headers:
                r = c.request(method, path, headers=h, json=body)
                assert r.status_code == 401, (method, path, h, r.status_code)
                assert r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/health").status_code == 200  # the liveness probe needs no key
        ok = c.post("/v1/completions", json=body,
                    headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200, ok.text
        ok = c.post("/v1/completions", json=body,
                    headers={"authorization": f"bearer {API_KEY}"})
        assert ok.status_code == 200, ok.text
    assert API_KEY not in server.proc.log()


# ---- generated requests ---------------------------------------------------------------------

junk = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=16),
    st.lists(st.integers(-5, 2000), max_size=4), st.dictionaries(st.text(max_size=4),
                                                                 st.integers(), max_size=2),
)
token_ids = st.lists(st.integers(-2, 1100), min_size=0, max_size=24)
# Text, sometimes with lone UTF-16 surrogates ("\ud800": not valid Unicode, once a 500).
text = st.text(max_size=48) | st.text(
    st.characters(categories=["Cs"]) | st.characters(codec="ascii"), min_size=1, max_size=8)


def fields_of(draw: st.DrawFn, good: dict[str, st.SearchStrategy[Any]],
              valid: dict[str, st.SearchStrategy[Any]],
              required: tuple[str, ...]) -> dict[str, Any]:
    """Half the bodies are valid (fields left out or drawn from `valid`), half mutated (fields
    left out, type-confused, or drawn from the wider `good`, and unknown fields added)."""
    body: dict[str, Any] = {}
    mutated = draw(st.booleans())
    for name, strat in good.items():
        r = draw(st.integers(0, 9))
        if r < 3 and name not in required and name not in valid:
            continue  # left out
        if not mutated:
            if name in valid and (r >= 3 or name in required):
                body[name] = draw(valid[name])
            continue
        if r == 0 and name not in required:
            continue
        body[name] = draw(junk) if r == 1 else draw(strat)
    if mutated and draw(st.integers(0, 3)) == 0:
        body[draw(st.text(max_size=8))] = draw(junk)
    return body


# NOTE: tiny positive temperatures and top_p values, NaN and infinities once killed the scheduler
# process (test_bad_sampling.py); they stay in the mix.
SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.floats(-1, 3) | st.sampled_from([5e-324, 1e-300, math.nan, math.inf]),
    "top_p": st.floats(-0.5, 1.5) | st.sampled_from([5e-324, 1e-300, math.nan]),
    "top_k": st.integers(-3, 50), "seed": st.integers(-(2**64), 2**64),
    "stop": text | st.lists(text, max_size=3), "stop_token_ids": token_ids,
    "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(),
}
VALID_SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1),
    "top_k": st.just(-1) | st.integers(1, 50), "seed": st.integers(0, 2**31),
    "stop": st.text(min_size=1, max_size=4), "stop_token_ids": st.lists(st.integers(0, 1000),
                                                                       max_size=2),
    "ignore_eos": st.booleans(),
}
OPENAI: dict[str, st.SearchStrategy[Any]] = {
    **SAMPLING, "max_tokens": st.integers(-2, 6), "n": st.integers(-1, 2),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries(
        {"include_usage": st.booleans()}), "logprobs": st.booleans() | st.integers(-1, 3),
    "user": text, "cache_salt": text, "model": text,
}
VALID_OPENAI: dict[str, st.SearchStrategy[Any]] = {
    **VALID_SAMPLING, "max_tokens": st.integers(1, 6), "n": st.integers(1, 2),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries(
        {"include_usage": st.booleans()}), "user": text, "cache_salt": text,
}
valid_ids = st.lists(st.integers(5, 1000), min_size=1, max_size=24)
valid_text = st.text(st.characters(codec="ascii", min_codepoint=32), min_size=1, max_size=48)


@st.composite
def completion(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    prompt = st.one_of(text, token_ids, st.lists(text, max_size=3),
                       st.lists(token_ids, max_size=3))
    valid = {**VALID_OPENAI, "prompt": valid_text | valid_ids, "echo": st.booleans()}
    body = fields_of(draw, {**OPENAI, "prompt": prompt, "echo": st.booleans()}, valid,
                     ("max_tokens", "prompt"))
    return "/v1/completions", body


@st.composite
def chat(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", ""]),
                                  "text": text})
    message = st.fixed_dictionaries({
        "role": st.sampled_from(["system", "user", "assistant", "tool", "", "x"]),
        "content": text | st.lists(part, max_size=2) | st.none(),
    })
    valid_message = st.fixed_dictionaries({
        "role": st.sampled_from(["system", "user", "assistant"]), "content": valid_text})
    good = {**OPENAI, "messages": st.lists(message, max_size=3),
            "max_completion_tokens": st.integers(-2, 6)}
    valid = {**VALID_OPENAI, "messages": st.lists(valid_message, min_size=1, max_size=3),
             "max_completion_tokens": st.integers(1, 6)}
    body = fields_of(draw, good, valid, ("max_tokens", "max_completion_tokens", "messages"))
    return "/v1/chat/completions", body


@st.composite
def generate(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    sampling = st.fixed_dictionaries({**SAMPLING, "max_new_tokens": st.integers(-2, 6)})
    valid_sampling = st.fixed_dictionaries({"max_new_tokens": st.integers(1, 6)},
                                           optional=VALID_SAMPLING)
    good = {"text": text | st.lists(text, max_size=3),
            "input_ids": token_ids | st.lists(token_ids, max_size=3),
            "sampling_params": sampling, "stream": st.booleans(), "rid": text,
            "extra_key": text}
    valid = {"input_ids": valid_ids | st.lists(valid_ids, min_size=1, max_size=2),
             "sampling_params": valid_sampling, "stream": st.booleans(), "extra_key": text}
    body = fields_of(draw, good, valid, ("sampling_params",))
    if "input_ids" in valid and not any(k in body for k in ("text", "input_ids")) \
            and draw(st.booleans()):
        body["text"] = draw(valid_text)
    sp = body.get("sampling_params")
    if isinstance(sp, dict) and draw(st.integers(0, 3)) == 0:
        sp[draw(st.sampled_from(sorted(sp) or ["x"]))] = draw(junk)
    if isinstance(sp, dict) and not isinstance(sp.get("max_new_tokens"), int):
        sp["max_new_tokens"] = 4  # never the 128-token default: keep the run short
    return "/generate", body


raw_bodies = st.one_of(
    st.binary(max_size=64), st.just(b""), st.just(b"{"), st.just(b"[]"), st.just(b"null"),
    st.just(b'{"prompt": "a", "max_tokens": 1e999}'), st.just(b'{"prompt": NaN}'),
    st.just(b"\xff\xfe{}"), st.just(b'{"prompt": "a", "max_tokens": 2, "temperature": NaN}'),
    st.just(b'{"input_ids": [5, 6], "sampling_params": {"temperature": 1e-320}}'),
    st.just(b'{"prompt": "' + b"a" * 300_000 + b'", "max_tokens": 1}'),
)


def check_response(r: httpx.Response, stream: bool) -> None:
    assert 200 <= r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 300:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"]
        return
    if stream and r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line for line in r.text.splitlines() if line]
        assert events, "empty stream"
        for line in events:
            assert line.startswith("data: "), line
            if line != "data: [DONE]":
                json.loads(line[6:])
        return
    json.loads(r.text)


@pytest.mark.slow
def test_generated_requests_get_2xx_or_4xx(server: Server) -> None:
    counts: dict[int, int] = {}
    with server.client(timeout=120) as c:

        @settings(max_examples=240, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(req=st.one_of(completion(), chat(), generate()))
        def one(req: tuple[str, dict[str, Any]]) -> None:
            path, body = req
            data = json.dumps(body, allow_nan=True).encode()  # NaN/Infinity: invalid JSON
            r = c.post(path, content=data, headers={"Content-Type": "application/json"})
            counts[r.status_code] = counts.get(r.status_code, 0) + 1
            check_response(r, bool(body.get("stream")))

        one()

        @settings(max_examples=40, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/generate",
                                     "/hicache/storage-backend"]), raw=raw_bodies)
        def raw(path: str, raw: bytes) -> None:
            method = "PUT" if path == "/hicache/storage-backend" else "POST"
            r = c.request(method, path, content=raw)
            counts[r.status_code] = counts.get(r.status_code, 0) + 1
            check_response(r, False)
            assert r.status_code != 200 or method == "POST"

        raw()
    assert counts.get(200, 0) > 20 and sum(v for k, v in counts.items() if k >= 400) > 20, counts
    s = server.stats()
    assert s["storage_backend"] == "hicache"
    assert server.proc.alive()


SURROGATE_CASES: list[tuple[str, str, str]] = [
    # (path, body with \ud800 written as JSON escapes, the field the error names)
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 1}', "prompt.1"),
    ("/v1/completions", '{"prompt": "a", "stop": ["\\ud800"], "max_tokens": 1}', "stop.0"),
    ("/v1/completions", '{"prompt": "a", "cache_salt": "\\ud800", "max_tokens": 1}',
     "cache_salt"),
    ("/v1/completions", '{"prompt": "a", "user": "\\udbff", "max_tokens": 1}', "user"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages.0.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "\\ud800", "content": "x"}]}',
     "messages.0.role"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages.0.content.0.text"),
    ("/generate", '{"text": "\\ud800", "sampling_params": {"max_new_tokens": 1}}', "text"),
    ("/generate", '{"text": "a", "rid": "\\ud800", "sampling_params": {"max_new_tokens": 1}}',
     "rid"),
    ("/generate", '{"text": "a", "extra_key": "\\ud800"}', "extra_key"),
    ("/generate", '{"text": "a", "sampling_params": {"stop": "x\\ud800"}}',
     "sampling_params.stop"),
    ("/generate", '{"text": "a", "\\ud800": 1}', "'\\ud800'"),
]


def test_lone_surrogates_are_a_400_naming_the_field(server: Server) -> None:
    with server.client() as c:
        for path, raw, param in SURROGATE_CASES:
            r = c.post(path, content=raw.encode(), headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (path, raw, r.text)
            err = r.json()["error"]
            assert (err["param"], err["code"]) == (param, "invalid_string"), (raw, err)
            assert "surrogate" in err["message"]
    assert server.proc.alive()


# ---- L3 outage seen through HTTP -----------------------------------------------------------


def generate_ids(server: Server, prompts: list[list[int]]) -> list[list[int]]:
    with server.client() as c:
        r = c.post("/generate", json={"input_ids": prompts, "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
        return [x["output_ids"] for x in r.json()]


@pytest.mark.slow
def test_store_killed_and_restarted_under_http(server: Server, reference: Reference) -> None:
    """The engine's `hicache-server` SIGKILLed: requests keep completing with the outputs of
    caching off, /hicache/stats counts the failures, and after the restart storage hits resume
    with no help."""
    first = make_prompts(8, 900)
    assert generate_ids(server, first) == reference(first)
    before = server.idle_and_flushed()
    server.store.kill()
    during = make_prompts(8, 901)
    assert generate_ids(server, first) == reference(first)
    assert generate_ids(server, during) == reference(during)
    out = server.idle_and_flushed()
    assert out["storage"]["errors"] > before["storage"]["errors"]
    assert out["storage_hit_tokens"] == before["storage_hit_tokens"]
    server.store.start()
    deadline = time.monotonic() + 90
    n = 0
    while True:
        n += 1
        fresh = make_prompts(8, 910 + n)
        assert generate_ids(server, fresh) == reference(fresh)
        hits = server.idle_and_flushed()["storage_hit_tokens"]
        assert generate_ids(server, fresh) == reference(fresh)
        if server.stats()["storage_hit_tokens"] > hits:
            break
        assert time.monotonic() < deadline, "storage hits never resumed"
        time.sleep(0.5)
    s = server.idle_and_flushed()
    assert s["storage"]["corrupt_pages"] == 0 and s["corrupt_pages"] == 0
    assert server.proc.alive()


# ---- load ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_64_clients_for_60s_complete_and_leak_nothing(server: Server) -> None:
    base_stats = server.idle_and_flushed()
    base = base_stats["usage"]
    assert base["device_pages_free"] == base["device_pages_total"]
    finished_before = server.stats()["scheduler"]["finished"]
    rnd = random.Random(7)
    systems = [[rnd.randrange(5, 1000) for _ in range(rnd.randint(24, 64))] for _ in range(6)]

    async def client(i: int, deadline: float, results: list[tuple[int, str]]) -> None:
        r = random.Random(i)
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            while time.monotonic() < deadline:
                prompt = r.choice(systems) + [r.randrange(5, 1000) for _ in range(r.randint(1,
                                                                                            24))]
                kind = r.random()
                try:
                    if kind < 0.6:
                        resp = await c.post("/v1/completions", json={
                            "prompt": prompt, "max_tokens": r.randint(1, 8), "ignore_eos": True,
                            "stream": kind < 0.15})
                        ok = resp.status_code == 200 and (
                            kind < 0.15 and resp.text.rstrip().endswith("data: [DONE]")
                            or kind >= 0.15 and resp.json()["usage"]["completion_tokens"] >= 1)
                    else:
                        resp = await c.post("/generate", json={
                            "input_ids": prompt, "extra_key": f"tenant-{i % 3}",
                            "sampling_params": {"max_new_tokens": r.randint(1, 8),
                                                "ignore_eos": True}})
                        ok = resp.status_code == 200 and len(resp.json()["output_ids"]) >= 1
                    results.append((resp.status_code, "" if ok else resp.text[:300]))
                except httpx.HTTPError as e:
                    results.append((-1, f"{type(e).__name__}: {e}"))

    async def run() -> list[tuple[int, str]]:
        results: list[tuple[int, str]] = []
        deadline = time.monotonic() + LOAD_SECONDS
        await asyncio.gather(*(client(i, deadline, results) for i in range(LOAD_CLIENTS)))
        return results

    results = asyncio.run(run())
    failed = [x for x in results if x[0] != 200 or x[1]]
    assert not failed, (len(failed), failed[:5])
    assert len(results) >= LOAD_CLIENTS
    after = server.idle_and_flushed()
    use = after["usage"]
    assert after["scheduler"]["finished"] - finished_before == len(results)
    assert after["hit_tokens"] > 0
    for k in ("device_pages_total", "device_pages_free", "host_pages_total", "host_pages_free"):
        assert use[k] == base[k], (k, use, base)
    assert (use["host_inflight_pages"], use["pending_prefetches"], use["pending_transfers"]) == (
        0, 0, 0)
    assert (use["device_cached_tokens"], use["host_cached_tokens"]) == (0, 0)
    assert after["storage"]["corrupt_pages"] == 0
    assert after["storage"]["errors"] == base_stats["storage"]["errors"]
    assert server.proc.alive()
