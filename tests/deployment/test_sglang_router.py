"""SGLang's own clients in front of `hicache-engine`s.

Two engines behind each real gateway, `smg` 1.13 and `sglang-router` 0.3.2 (sgl-model-gateway,
which adds SGLang's request fields, at their defaults, to every body it forwards), with the
`round_robin` and `cache_aware` policies: every endpoint they proxy (`/v1/completions`,
`/v1/chat/completions`, `/generate`), streamed and not, answers what the engine answers
directly. Then `python -m sglang.bench_serving --backend sglang` against one engine.

`make setup` installs sglang-router in `.venv/sglang-router` (off sys.path: it ships an `smg`
script of its own) and bench_serving's imports in `.venv/sglang-bench`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.demo_model import ensure_demo_model
from tests.deployment.cluster import Gateway, start_engines
from tests.engine.test_server_api import REPO_ROOT, EngineServer, sse_events
from tests.integrations.sglang_env import TORCHVISION_DIR, sglang_skip_reason
from tests.procs import ManagedProcess, free_port

pytestmark = pytest.mark.slow

ROUTER_DIR = Path(sys.prefix) / "sglang-router"
BENCH_DIR = Path(sys.prefix) / "sglang-bench"
FLAGS = ["--max-total-tokens", "4096", "--max-running-requests", "8"]
PAGE = 32
# About 130 demo-model tokens: four full pages.
PREFIX = " ".join(f"Berth {i} takes ferries of class {i % 3}." for i in range(14))


class SglangRouter(Gateway):
    """`python -m sglang_router launch` (sglang-router's own entry point, from its directory)."""

    def __init__(self, tmp: Path, workers: Sequence[str], policy: str) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        argv = [sys.executable, "-m", "sglang_router", "launch", "--host", "127.0.0.1",
                "--port", str(self.port), "--worker-urls", *workers, "--policy", policy,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
                "--log-level", "info"]
        self.proc = ManagedProcess(argv, Path(tmp) / f"sglang-router-{self.port}.log",
                                   env={"PYTHONPATH": str(ROUTER_DIR)}, cwd=REPO_ROOT)


def gateway(kind: str, tmp: Path, workers: Sequence[str], policy: str) -> Gateway:
    if kind == "smg":
        return Gateway(tmp, workers, policy)
    if not (ROUTER_DIR / "sglang_router").is_dir():
        pytest.skip(f"sglang-router is not installed in {ROUTER_DIR} (make setup installs it)")
    return SglangRouter(tmp, workers, policy)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineServer]]:
    tmp = tmp_path_factory.mktemp("sglang-router")
    started = start_engines(tmp, 2, FLAGS)
    try:
        yield started
    finally:
        for e in started:
            e.stop()


# What a client of SGLang sends (greedy, so every engine answers the same).
BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": "hicache-demo", "prompt": "The ferry to pier 4",
                        "max_tokens": 5, "temperature": 0, "ignore_eos": True},
    "/v1/chat/completions": {"model": "hicache-demo", "max_tokens": 5, "temperature": 0,
                             "ignore_eos": True,
                             "messages": [{"role": "user", "content": "Which pier floods?"}]},
    "/generate": {"text": "The tide table lists", "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}},
}


def answer(path: str, body: dict[str, Any]) -> tuple[str, int]:
    """The text and the completion tokens of a non-streamed response."""
    if path == "/generate":
        return body["text"], len(body["output_ids"])
    ch = body["choices"][0]
    return ch["text"] if "text" in ch else ch["message"]["content"], \
        body["usage"]["completion_tokens"]


def streamed(path: str, events: list[Any]) -> str:
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), events
    if path == "/generate":
        return str(events[-2]["text"])
    return "".join(e["choices"][0].get("text", e["choices"][0].get("delta", {}).get("content"))
                   or "" for e in events[:-1] if e["choices"])


def call(url: str, path: str, body: dict[str, Any]) -> tuple[str, int]:
    with httpx.Client(base_url=url, timeout=300) as c:
        r = c.post(path, json=body)
    assert r.status_code == 200, (url, path, r.text)
    return answer(path, r.json())


def call_streamed(url: str, path: str, body: dict[str, Any]) -> str:
    with httpx.Client(base_url=url, timeout=300) as c, \
            c.stream("POST", path, json={**body, "stream": True}) as s:
        assert s.status_code == 200, (url, path, s.read())
        return streamed(path, sse_events(s.iter_lines()))


def finished(engines: list[EngineServer]) -> list[int]:
    return [int(e.stats()["scheduler"]["finished"]) for e in engines]


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
@pytest.mark.parametrize("kind", ["smg", "sglang-router"])
def test_every_endpoint_through_the_gateway(engines: list[EngineServer], kind: str,
                                            policy: str, tmp_path: Path) -> None:
    direct = {path: call(engines[0].url, path, body) for path, body in BODIES.items()}
    gw = gateway(kind, tmp_path, [e.url for e in engines], policy)
    try:
        gw.start(2)
        before = finished(engines)
        for path, body in BODIES.items():
            assert call(gw.url, path, body) == direct[path], (kind, policy, path)
            assert call_streamed(gw.url, path, body) == direct[path][0], (kind, policy, path)
        after = finished(engines)
        served = [a - b for a, b in zip(after, before)]
        assert sum(served) == 2 * len(BODIES)
        if policy == "round_robin":
            assert served == [len(BODIES), len(BODIES)], served
        else:
            # cache_aware sends a prompt back to the engine that holds its prefix: a second
            # request finds the first one's full pages on that engine's device.
            gen = {"text": PREFIX + f" ({kind})", "sampling_params": {
                "max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}
            with httpx.Client(base_url=gw.url, timeout=300) as c:
                first = c.post("/generate", json=gen).json()["meta_info"]
                second = c.post("/generate", json=gen).json()["meta_info"]
            assert first["prompt_tokens"] > 3 * PAGE
            assert second["cached_tokens"] == (first["prompt_tokens"] - 1) // PAGE * PAGE
    finally:
        gw.stop()


BENCH = """
import runpy, sys
from tests.integrations.sglang_env import load_sglang_pools
load_sglang_pools()  # torchvision, which SGLang's tokenizer helpers import, on a CPU torch
sys.argv = ["bench_serving", *sys.argv[1:]]
runpy.run_module("sglang.bench_serving", run_name="__main__")
"""


def test_sglang_bench_serving(engines: list[EngineServer], tmp_path: Path) -> None:
    skip = sglang_skip_reason()
    if skip is not None:
        pytest.skip(skip)
    if not (BENCH_DIR / "datasets").is_dir():
        pytest.skip(f"bench_serving's imports are not installed in {BENCH_DIR} (make setup)")
    assert TORCHVISION_DIR.is_dir()
    engine = engines[0]
    out = tmp_path / "bench.jsonl"
    before = engine.stats()["scheduler"]["finished"]
    argv = [sys.executable, "-c", BENCH, "--backend", "sglang", "--host", "127.0.0.1",
            "--port", str(engine.port), "--dataset-name", "random-ids", "--num-prompts", "4",
            "--random-input-len", "16", "--random-output-len", "4", "--random-range-ratio", "1",
            "--tokenizer", str(ensure_demo_model()), "--warmup-requests", "1",
            "--disable-tqdm", "--output-file", str(out)]
    env = {**os.environ, "PYTHONPATH": f"{BENCH_DIR}:{REPO_ROOT}", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(argv, env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text().splitlines()[-1])
    assert (result["completed"], result["total_input_tokens"],
            result["total_output_tokens"]) == (4, 64, 16), result
    # The warm-up request and the four measured ones, all finished by this engine.
    assert engine.stats()["scheduler"]["finished"] - before == 5
