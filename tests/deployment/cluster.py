"""Real processes for the deployment tests: `hicache-engine`s sharing one `hicache-server`, and
the SGLang model gateway (`smg`) in front of them. Everything binds 127.0.0.1 on free ports and
is always stopped."""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.engine.test_server_api import REPO_ROOT, EngineServer
from tests.procs import ManagedProcess, free_port
from tests.storage_backends.hicache_server_proc import HiCacheServerProc

PAGE = 32  # the engine's default page size
# About 1,600 demo-model tokens; deterministic, so every engine derives the same page keys.
LONG_PROMPT = " ".join(
    f"Entry {i}: the tide table for pier {i % 7} lists high water at {i % 12} o'clock."
    for i in range(50)
)


def l3_flags(store: HiCacheServerProc, *extra: str) -> list[str]:
    """The flags of an engine on the shared store, default settings otherwise."""
    return ["--enable-hierarchical-cache", "--hicache-storage-backend", "hicache",
            "--hicache-storage-backend-extra-config", json.dumps({"url": store.url}), *extra]


def generate(url: str, text: str, n: int = 8, timeout: float = 300.0) -> dict[str, Any]:
    r = httpx.post(f"{url}/generate", timeout=timeout, json={
        "text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                          "ignore_eos": True}})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def wait_store_pages(store: HiCacheServerProc, pages: int, timeout: float = 120.0) -> int:
    """Block until the store itself holds at least `pages` pages (asked of the server, so no
    engine is woken up by the question); returns the count."""
    client = store.client()
    try:
        deadline = time.monotonic() + timeout
        while True:
            n = int(client.server_stats()["pages"])
            if n >= pages:
                return n
            if time.monotonic() > deadline:
                raise TimeoutError(f"the store holds {n} pages, expected {pages}")
            time.sleep(0.05)
    finally:
        client.close()


def smg_binary() -> str:
    exe = Path(sys.executable).parent / "smg"
    found = str(exe) if exe.exists() else shutil.which("smg")
    if found is None:  # (make setup installs it; a bare GPU machine may lack it)
        import pytest

        pytest.skip("the `smg` gateway is not installed (pip install smg)")
    return found


class Gateway:
    """`smg launch` on a free loopback port in front of `workers`."""

    def __init__(self, tmp: Path, workers: Sequence[str], policy: str = "round_robin",
                 args: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        argv = [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(self.port),
                "--worker-urls", *workers, "--policy", policy,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
                "--disable-tokenizer-autoload", "--log-level", "info", *args]
        self.proc = ManagedProcess(argv, Path(tmp) / f"smg-{self.port}.log", cwd=REPO_ROOT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, n_workers: int, timeout: float = 120.0) -> Gateway:
        """Start it and wait until it routes to `n_workers` healthy workers."""
        self.proc.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise RuntimeError(f"smg exited:\n{self.proc.log()[-4000:]}")
            try:
                if len(self.healthy_workers()) >= n_workers:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"smg not ready with {n_workers} workers:\n{self.proc.log()[-4000:]}")

    def workers(self) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.url}/workers", timeout=10)
        r.raise_for_status()
        body = r.json()
        return list(body.get("workers", body) if isinstance(body, dict) else body)

    def healthy_workers(self) -> list[str]:
        return sorted(w["url"] for w in self.workers() if w.get("is_healthy", True))

    def stop(self) -> None:
        # Nothing to flush: a gateway keeps no state worth a graceful drain (which waits ~5 s).
        self.proc.kill()


@dataclass
class Attempts:
    """What a retrying client saw for one request."""

    status: int = 0
    tries: int = 0
    errors: list[str] = field(default_factory=list)
    body: dict[str, Any] = field(default_factory=dict)


def post_with_retries(url: str, path: str, body: dict[str, Any], tries: int = 20,
                      timeout: float = 300.0) -> Attempts:
    """POST as a real client would: retry on a connection error or a 5xx, with backoff."""
    out = Attempts()
    for i in range(tries):
        out.tries += 1
        try:
            r = httpx.post(url + path, json=body, timeout=timeout)
        except httpx.TransportError as e:
            out.errors.append(type(e).__name__)
        else:
            out.status = r.status_code
            if r.status_code < 500:
                out.body = r.json() if r.status_code == 200 else {"error": r.text}
                return out
            out.errors.append(f"HTTP {r.status_code}")
        time.sleep(min(0.2 * (i + 1), 2.0))
    return out


def start_engines(tmp: Path, n: int, flags: Sequence[str], name: str = "engine"
                  ) -> list[EngineServer]:
    """Start `n` engines at once (their start-ups overlap) and wait for all of them."""
    engines = [EngineServer(tmp, flags, name=f"{name}-{i}") for i in range(n)]
    try:
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready()
    except BaseException:
        for e in engines:
            e.proc.kill()
        raise
    return engines
