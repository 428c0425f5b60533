"""The HTTP API of a real `hicache-engine` process (front end + scheduler process) serving the
demo model: OpenAI completions and chat (plain, streamed, through the `openai` client), SGLang's
/generate, /metrics, /hicache/*, API keys, 400s for bad requests, 32+ concurrent requests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.args import EngineArgs
from engine.demo_model import ensure_demo_model
from tests.procs import ManagedProcess, free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key-123"
READY = "hicache-engine ready on http://"
# A small device pool keeps every test engine's memory low.
SMALL_POOL = ("--max-total-tokens", "16384")


class EngineServer:
    """One `python -m engine` on a free loopback port; `start()` returns once it printed its
    ready line."""

    def __init__(self, tmp: Path, flags: Sequence[str] = (), name: str = "engine",
                 api_key: str | None = None, port: int | None = None) -> None:
        ensure_demo_model()  # built once, before any engine process looks for it
        self.tmp = Path(tmp)
        self.port = port or free_port()
        self.api_key = api_key
        argv = [sys.executable, "-m", "engine", "--host", "127.0.0.1", "--port", str(self.port),
                *SMALL_POOL, *flags]
        if api_key:
            argv += ["--api-key", api_key]
        self.name = name
        self.proc = ManagedProcess(argv, self.tmp / f"{name}.log", cwd=REPO_ROOT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self) -> EngineServer:
        self.proc.start()
        return self

    def wait_ready(self, timeout: float = 240.0) -> EngineServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if READY in self.proc.log():
                return self
            if not self.proc.alive():
                raise RuntimeError(f"{self.name} exited before ready:\n{self.proc.log()[-4000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.proc.log()[-4000:]}")

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def get(self, path: str) -> Any:
        with self.client() as c:
            r = c.get(path)
            assert r.status_code == 200, r.text
            return r.json()

    def post(self, path: str, body: Any) -> Any:
        with self.client() as c:
            r = c.post(path, json=body)
            assert r.status_code == 200, r.text
            return r.json()

    def stats(self) -> dict[str, Any]:
        return dict(self.get("/hicache/stats"))

    def wait_transfers(self, timeout: float = 60.0) -> dict[str, Any]:
        """Poll /hicache/stats until no cache transfer is pending (backups reached L3)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if s["usage"]["pending_transfers"] == 0 and s["usage"]["host_inflight_pages"] == 0:
                return s
            if time.monotonic() > deadline:
                raise TimeoutError(f"transfers still pending: {s['usage']}")
            time.sleep(0.1)

    def stop(self) -> int | None:
        self.proc.stop(timeout=60)
        return self.proc.proc.returncode if self.proc.proc else None


@contextmanager
def engine_server(tmp: Path, flags: Sequence[str] = (), **kw: Any) -> Iterator[EngineServer]:
    """Start an engine, yield it once it is ready, always stop it."""
    srv = EngineServer(tmp, flags, **kw).start()
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pid: int, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return False


def sse_events(lines: Iterator[str]) -> list[Any]:
    """Parse an SSE body: every event is `data: ...` followed by a blank line; the last is
    `data: [DONE]`."""
    events: list[Any] = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        if payload == "[DONE]":
            events.append("[DONE]")
            continue
        events.append(json.loads(payload))
    return events


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    tmp = tmp_path_factory.mktemp("server-api")
    srv = EngineServer(
        tmp,
        [
            "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", json.dumps({"path": str(tmp / "pages")}),
            "--enable-metrics", "--request-log", str(tmp / "requests.jsonl"),
        ],
        api_key=API_KEY,
    ).start()
    try:
        yield srv.wait_ready()
    finally:
        # Ctrl-C in a terminal: SIGINT to the whole process group. Both processes end cleanly.
        if srv.proc.alive():
            os.killpg(srv.proc.pid, signal.SIGINT)
        assert srv.proc.proc is not None
        try:
            code = srv.proc.proc.wait(timeout=120)
        finally:
            srv.proc.kill()
        assert code == 0, srv.proc.log()[-4000:]
        assert "scheduler exited with 0" in srv.proc.log()


def test_help_lists_every_field() -> None:
    out = subprocess.run([sys.executable, "-m", "engine", "--help"], capture_output=True,
                         text=True, cwd=REPO_ROOT, check=True).stdout
    for name in EngineArgs.field_names():
        assert "--" + name.replace("_", "-") in out, name
    assert "--hicache-storage-prefetch-policy {best_effort,wait_complete,timeout}" in out
    assert "(default: 30000)" in out and "(default: 127.0.0.1)" in out


def test_port_in_use_fails_fast() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "engine", "--port", str(port)],
                           capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert r.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr
    assert "Traceback" not in r.stderr


def test_health_models_and_ready_line(server: EngineServer) -> None:
    log = server.proc.log()
    assert log.count(READY) == 1
    assert f"{READY}127.0.0.1:{server.port} (model hicache-demo, storage file" in log
    r = httpx.get(server.url + "/health")  # no key needed
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    models = server.get("/v1/models")
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["hicache-demo"]
    assert models["data"][0]["max_model_len"] == 4096


def test_api_key_enforced(server: EngineServer) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                             ("GET", "/metrics"), ("GET", "/hicache/stats")):
            r = httpx.request(method, server.url + path, headers=headers,
                              json={"prompt": "x", "max_tokens": 1})
            assert r.status_code == 401, (headers, path, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error"
            assert set(err) == {"message", "type", "param", "code"}


def test_completions(server: EngineServer) -> None:
    body = {"model": "hicache-demo", "prompt": "The lighthouse keeper", "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    out = server.post("/v1/completions", body)
    assert out["object"] == "text_completion" and out["model"] == "hicache-demo"
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    u = out["usage"]
    assert u["completion_tokens"] == 12
    assert u["total_tokens"] == u["prompt_tokens"] + 12
    assert u["prompt_tokens_details"]["cached_tokens"] == 0
    again = server.post("/v1/completions", body)
    assert again["choices"][0]["text"] == choice["text"]  # greedy is deterministic
    # Token-id prompts and a batch of prompts.
    ids = server.post("/generate", {"text": "The lighthouse keeper",
                                    "sampling_params": {"max_new_tokens": 0}})
    assert ids["meta_info"]["prompt_tokens"] == u["prompt_tokens"]
    batch = server.post("/v1/completions", {**body, "prompt": ["The lighthouse keeper", "A b"]})
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert batch["choices"][0]["text"] == choice["text"]
    assert batch["usage"]["completion_tokens"] == 24


def test_completions_stream_sse(server: EngineServer) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0,
            "ignore_eos": True}
    full = server.post("/v1/completions", body)["choices"][0]["text"]
    with server.client() as c, c.stream(
        "POST", "/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    assert raw.endswith("data: [DONE]\n\n")
    events = sse_events(iter(raw.split("\n")))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 10
    text_chunks = chunks[:-1]
    assert len(text_chunks) >= 2  # incremental, not one blob
    assert all(ch["object"] == "text_completion" for ch in text_chunks)
    assert [ch["choices"][0]["finish_reason"] for ch in text_chunks][-1] == "length"
    assert all(ch["choices"][0]["finish_reason"] is None for ch in text_chunks[:-1])
    assert "".join(ch["choices"][0]["text"] for ch in text_chunks) == full


def test_openai_client_chat(server: EngineServer) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."}]
    resp = client.chat.completions.create(model="hicache-demo", messages=messages,  # type: ignore[arg-type]
                                          max_tokens=8, temperature=0)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    text = resp.choices[0].message.content
    assert isinstance(text, str)
    assert resp.usage is not None and resp.usage.completion_tokens <= 8
    assert resp.usage.prompt_tokens_details is not None
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.chat.completions.create(model="hicache-demo", messages=messages,  # type: ignore[arg-type]
                                            max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(pieces) == text
    assert finish == resp.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == resp.usage.completion_tokens
    comp = client.completions.create(model="hicache-demo", prompt="Hello", max_tokens=4,
                                     temperature=0)
    assert comp.usage is not None and comp.usage.completion_tokens <= 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="hicache-demo", prompt="Hi", max_tokens=-1)


def test_generate_native(server: EngineServer) -> None:
    sp = {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True}
    out = server.post("/generate", {"text": "In the morning", "sampling_params": sp})
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 9 == len(out["output_ids"])
    assert meta["finish_reason"] == {"type": "length", "length": 9}
    assert meta["cached_tokens"] == 0
    ids = server.post("/generate", {"text": "In the morning",
                                    "sampling_params": {"max_new_tokens": 0}})
    prompt_len = ids["meta_info"]["prompt_tokens"]
    assert prompt_len == meta["prompt_tokens"]
    # Streaming: cumulative text and ids, the last event equals the non-streamed answer.
    with server.client() as c, c.stream("POST", "/generate", json={
        "text": "In the morning", "sampling_params": sp, "stream": True,
    }) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["text"] == out["text"] and last["output_ids"] == out["output_ids"]
    assert [len(e["output_ids"]) for e in events[:-1]] == list(range(1, 10))
    # A stop token id ends the output right there.
    stop_id = out["output_ids"][3]
    cut = server.post("/generate", {"text": "In the morning",
                                    "sampling_params": {**sp, "stop_token_ids": [stop_id]}})
    first = out["output_ids"].index(stop_id)
    assert cut["output_ids"] == out["output_ids"][: first + 1]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    # A batch of texts.
    batch = server.post("/generate", {"text": ["In the morning", "At night"],
                                      "sampling_params": sp})
    assert isinstance(batch, list) and batch[0]["output_ids"] == out["output_ids"]


def test_stop_string_cuts_text(server: EngineServer) -> None:
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    out = server.post("/generate", {"text": "The river", "sampling_params": sp})
    text = out["text"]
    stop = text[4:7]
    assert stop.strip() and "\ufffd" not in stop
    cut = server.post("/generate", {"text": "The river",
                                    "sampling_params": {**sp, "stop": [stop]}})
    assert cut["text"] == text[: text.index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    with server.client() as c, c.stream("POST", "/v1/completions", json={
        "prompt": "The river", "max_tokens": 16, "ignore_eos": True, "stop": stop,
        "stream": True,
    }) as r:
        events = sse_events(r.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == cut["text"]


def test_multiturn_conversation_cached_second_time(server: EngineServer) -> None:
    system = ("You are the archivist of a small harbour town. Answer every question about "
              "ships, tides and the lighthouse with care, and keep each answer short. ") * 3
    questions = ["When does the ferry leave on Sundays?", "And when does it come back?",
                 "Who keeps the lighthouse now?"]

    def converse() -> list[tuple[str, int, int]]:
        messages = [{"role": "system", "content": system}]
        turns = []
        for q in questions:
            messages.append({"role": "user", "content": q})
            out = server.post("/v1/chat/completions", {
                "messages": messages, "max_tokens": 12, "temperature": 0,
            })
            reply = out["choices"][0]["message"]["content"]
            u = out["usage"]
            turns.append((reply, u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]))
            messages.append({"role": "assistant", "content": reply})
        return turns

    before = server.stats()
    first = converse()
    second = converse()
    assert first[0][2] == 0  # a new system prompt: nothing cached yet
    assert all(c > 0 for _, _, c in first[1:])  # later turns reuse the history
    assert [t[0] for t in second] == [t[0] for t in first]  # identical greedy text
    for (_, p1, c1), (_, p2, c2) in zip(first, second):
        assert p1 == p2
        assert c2 > 0 and c2 >= c1
        assert c2 == (p2 - 1) // 32 * 32  # every full page of the prompt (but the last token)
    after = server.stats()
    assert after["device_hit_tokens"] - before["device_hit_tokens"] >= sum(
        c for _, _, c in second)


def test_bad_requests_get_400(server: EngineServer) -> None:
    long_ids = [5] * 5000  # longer than the 4096-token context
    cases: list[tuple[str, Any]] = [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", b"[1, 2]"),
        ("/v1/completions", b""),
        ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}'),
        ("/v1/completions", b'{"prompt": "hi", "top_p": Infinity}'),
        ("/v1/completions", {"max_tokens": 4}),  # no prompt
        ("/v1/completions", {"prompt": 17}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "10"}),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}),
        ("/v1/completions", {"prompt": "hi", "top_p": 2.0}),
        ("/v1/completions", {"prompt": "hi", "n": 0}),
        ("/v1/completions", {"prompt": "hi", "n": 10**6}),
        ("/v1/completions", {"prompt": ["hi"] * 600, "n": 2}),  # over 1024 generations
        ("/v1/completions", {"prompt": "hi", "frequency_penalty": 5.0}),
        ("/v1/completions", {"prompt": "hi", "no_such_field": 1}),
        ("/v1/completions", b'{"prompt": "\\ud800"}'),
        ("/v1/completions", {"prompt": "hi", "stream": "yes"}),
        ("/v1/completions", {"prompt": long_ids}),
        ("/v1/completions", {"prompt": [99999]}),
        ("/v1/completions", {"prompt": ""}),
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/chat/completions", {"messages": "hello"}),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 30000}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "max_completion_tokens": -5}),
        ("/generate", {"text": "a", "input_ids": [1, 2]}),
        ("/generate", {}),
        ("/generate", {"text": "a", "sampling_params": {"no_such_param": 1}}),
        ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 1.5}}),
        ("/generate", {"text": "a", "sampling_params": {"top_k": 0}}),
        ("/generate", {"input_ids": long_ids}),
        ("/hicache/storage-backend", {"extra_config": {}}),
    ]
    with server.client() as c:
        for path, body in cases:
            method = "PUT" if path == "/hicache/storage-backend" else "POST"
            if isinstance(body, bytes):
                r = c.request(method, path, content=body,
                              headers={"content-type": "application/json"})
            else:
                r = c.request(method, path, json=body)
            assert r.status_code == 400, (path, body if len(str(body)) < 200 else "...", r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["type"] == "invalid_request_error" and err["message"]
        r = c.post("/v1/completions", json={"prompt": long_ids})
        assert r.json()["error"]["code"] == "context_length_exceeded"
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1})
        assert r.json()["error"]["param"] == "max_tokens"
        r = c.get("/no/such/endpoint")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        # Still serving.
        ok = c.post("/v1/completions", json={"prompt": "still alive?", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 3


def test_concurrent_requests_all_complete(server: EngineServer) -> None:
    n = 40

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers,
                                     timeout=300) as c:
            async def one(i: int) -> httpx.Response:
                if i % 3 == 0:
                    return await c.post("/generate", json={
                        "text": f"Request number {i} asks", "sampling_params": {
                            "max_new_tokens": 6 + i % 5, "ignore_eos": True}})
                return await c.post("/v1/completions", json={
                    "prompt": f"Request number {i} asks", "max_tokens": 6 + i % 5,
                    "ignore_eos": True})
            return await asyncio.gather(*(one(i) for i in range(n)))

    before = server.stats()["scheduler"]["finished"]
    responses = asyncio.run(run())
    for i, r in enumerate(responses):
        assert r.status_code == 200, r.text
        body = r.json()
        got = (body["meta_info"]["completion_tokens"] if i % 3 == 0
               else body["usage"]["completion_tokens"])
        assert got == 6 + i % 5
    assert server.stats()["scheduler"]["finished"] - before == n


def test_metrics(server: EngineServer) -> None:
    long_prompt = "Metrics please, for the harbour master's monthly report. " * 8
    for _ in range(2):  # the second time the prompt is a cache hit
        server.post("/v1/completions", {"prompt": long_prompt, "max_tokens": 3})
    with server.client() as c:
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values: dict[str, float] = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    for name in (
        "hicache:cache_hit_rate", "hicache:prefetched_tokens_total",
        "hicache:backuped_tokens_total", "hicache:evicted_tokens_total",
        "hicache:load_back_tokens_total", "hicache:device_hit_tokens_total",
        "hicache:host_hit_tokens_total", "hicache:storage_hit_tokens_total",
        "hicache:time_to_first_token_seconds_count", "hicache:inter_token_latency_seconds_count",
        "hicache:prompt_tokens_total", "hicache:generation_tokens_total",
        "hicache:num_running_reqs", "hicache:num_queue_reqs", "hicache:token_usage",
        "hicache:prefetch_bandwidth_count", "hicache:backup_bandwidth_count",
    ):
        assert name in values, name
    assert values["hicache:prompt_tokens_total"] > 0
    assert values["hicache:generation_tokens_total"] > 0
    assert values["hicache:time_to_first_token_seconds_count"] > 0
    assert values["hicache:num_running_reqs"] == 0
    assert 0 < values["hicache:cache_hit_rate"] < 1
    stats = server.stats()
    assert values["hicache:device_hit_tokens_total"] == stats["device_hit_tokens"]
    # Every page written through to L3 (file backend) is counted as backed-up tokens.
    server.wait_transfers()
    with server.client() as c:
        text = c.get("/metrics").text
    backuped = [float(x.split()[-1]) for x in text.splitlines()
                if x.startswith("hicache:backuped_tokens_total ")]
    assert backuped and backuped[0] == server.stats()["storage_backup_pages"] * 32 > 0
    # Where every storage-hit token went: one labelled counter per outcome, as in the stats,
    # summing to the tokens probed.
    stats = server.stats()
    outcomes = {ln.split('"')[1]: float(ln.split()[-1]) for ln in text.splitlines()
                if ln.startswith("hicache:storage_hit_outcome_tokens_total{")}
    assert outcomes == {k: float(v) for k, v in stats["storage_hit_outcomes"].items()}
    assert sum(outcomes.values()) == stats["storage_probed_tokens"] == float(
        [ln for ln in text.splitlines()
         if ln.startswith("hicache:storage_probed_tokens_total ")][0].split()[-1])


def test_request_log_reaches_engine(server: EngineServer) -> None:
    server.post("/generate", {"text": "log me", "sampling_params": {"max_new_tokens": 2}})
    log = server.tmp / "requests.jsonl"
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert lines and {"rid", "input_ids", "output_ids", "cached_tokens"} <= set(lines[-1])


def test_client_disconnect_aborts_request(server: EngineServer) -> None:
    """A non-streaming client that gives up frees its request in the engine."""
    def busy() -> int:
        sched = server.stats()["scheduler"]
        return int(sched["running"] + sched["waiting"])

    def aborted() -> float:
        with server.client() as c:
            text = c.get("/metrics").text
        return float(text.split("\nhicache:num_aborted_requests_total ")[1].split()[0])

    before = aborted()
    body = {"prompt": "a long answer, please", "max_tokens": 3500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=server.headers,
                   timeout=httpx.Timeout(30, read=1.5))
    deadline = time.monotonic() + 60
    while busy():
        assert time.monotonic() < deadline, "the request outlived its client"
        time.sleep(0.05)
    assert aborted() == before + 1


def test_storage_backend_endpoints(server: EngineServer) -> None:
    pages = server.tmp / "pages"
    got = server.get("/hicache/storage-backend")
    assert got == {"backend": "file", "extra_config": {"path": str(pages)}}
    with server.client() as c:
        # Busy: a long request in flight makes attach/detach answer 409.
        with c.stream("POST", "/generate", json={
            "text": "keep busy", "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}) as r:
            it = r.iter_lines()
            next(line for line in it if line.startswith("data: "))
            for method in ("PUT", "DELETE"):
                busy = c.request(method, "/hicache/storage-backend",
                                 json={"backend": "memory"})
                assert busy.status_code == 409, busy.text
                assert busy.json()["error"]["code"] == "busy"
        # Closing the stream aborted that request; wait until the scheduler is idle.
        deadline = time.monotonic() + 60
        while server.stats()["scheduler"]["running"] + server.stats()["scheduler"]["waiting"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # A prompt of several pages, so this test does not rely on earlier ones for L3 pages.
        r = c.post("/generate", json={"text": "page " * 200,
                                      "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200, r.text
        server.wait_transfers()
        assert any(pages.rglob("*")), "write-through reached the file store"
        r = c.post("/hicache/storage-backend/clear")
        assert r.status_code == 200 and r.json()["cleared"] is True
        assert server.stats()["storage"] is not None
        r = c.delete("/hicache/storage-backend")
        assert r.status_code == 200 and r.json()["detached"] == "file"
        assert server.get("/hicache/storage-backend")["backend"] is None
        assert server.stats()["storage"] is None
        r = c.post("/hicache/storage-backend/clear")
        assert r.status_code == 400
        r = c.put("/hicache/storage-backend", json={"backend": "no-such-backend"})
        assert r.status_code == 400 and "no-such-backend" in r.json()["error"]["message"]
        r = c.put("/hicache/storage-backend", json={
            "backend": "memory", "extra_config": {"password": "s3cret"}})
        assert r.status_code == 200, r.text
        assert server.get("/hicache/storage-backend") == {
            "backend": "memory", "extra_config": {"password": "***"}}
        assert server.stats()["storage_backend"] == "memory"
        out = c.post("/generate", json={"text": "after attach " * 40,
                                        "sampling_params": {"max_new_tokens": 2}})
        assert out.status_code == 200
        server.wait_transfers()
        r = c.post("/flush_cache")
        assert r.status_code == 200 and r.json() == {"flushed": True}
        assert server.stats()["usage"]["device_cached_tokens"] == 0
