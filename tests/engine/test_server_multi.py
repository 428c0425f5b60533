"""Several engine processes and one shared L3: two engines on one `hicache-server` (a prefix
computed by A is a storage hit on B), an engine restarted on the same file store, and process
lifecycle (killing either process ends the other)."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.engine.test_server_api import EngineServer, pid_alive, wait_gone
from tests.storage_backends.hicache_server_proc import HiCacheServerProc

PAGE = 32
# Well above the 256-token prefetch threshold, so that B's request starts an L3 prefetch.
LONG_PROMPT = " ".join(
    f"Entry {i}: the tide table for pier {i % 7} lists high water at {i % 12} o'clock."
    for i in range(40)
)
L3_FLAGS = ["--enable-hierarchical-cache", "--hicache-storage-prefetch-policy", "wait_complete"]


def generate(srv: EngineServer, text: str, n: int = 12) -> dict[str, Any]:
    out: dict[str, Any] = srv.post("/generate", {
        "text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                          "ignore_eos": True}})
    return out


@contextmanager
def engines_on_one_store(tmp: Path, flags: Sequence[str], names: tuple[str, str],
                         kill: bool = False) -> Iterator[tuple[EngineServer, EngineServer]]:
    """A real `hicache-server` and two engines started together with `flags`, both ready, each
    with that server as its L3. On exit the engines are stopped (SIGKILLed with `kill`), then
    the server."""
    store = HiCacheServerProc(tmp, capacity="256MiB").start()
    flags = [*flags, *L3_FLAGS, "--hicache-storage-backend", "hicache",
             "--hicache-storage-backend-extra-config", json.dumps({"url": store.url})]
    a, b = (EngineServer(tmp, flags, name=n).start() for n in names)
    try:
        yield a.wait_ready(), b.wait_ready()
    finally:
        for e in (a, b):
            if kill:
                e.proc.kill()
            else:
                e.stop()
        store.stop()


def test_two_engines_share_one_hicache_server(tmp_path: Path) -> None:
    with engines_on_one_store(tmp_path, [], ("engine-a", "engine-b")) as (a, b):
        out_a = generate(a, LONG_PROMPT)
        prompt_tokens = out_a["meta_info"]["prompt_tokens"]
        assert prompt_tokens > 300
        assert out_a["meta_info"]["cached_tokens"] == 0
        sa = a.wait_transfers()
        # Every full page of prompt + output (but the last token) went to the shared store.
        assert sa["storage_backup_pages"] >= (prompt_tokens - 1) // PAGE
        assert sa["storage_errors"] == 0
        out_b = generate(b, LONG_PROMPT)
        assert out_b["output_ids"] == out_a["output_ids"]
        assert out_b["text"] == out_a["text"]
        sb = b.stats()
        assert sb["storage_hit_tokens"] > 0
        assert sb["storage_hit_tokens"] == out_b["meta_info"]["cached_tokens"]
        assert out_b["meta_info"]["cached_tokens"] == (prompt_tokens - 1) // PAGE * PAGE
        assert sb["device_hit_tokens"] == 0 and sb["prefetch_pages"] > 0
        assert sb["corrupt_pages"] == 0
        assert b.get("/hicache/storage-backend")["backend"] == "hicache"
    assert "Traceback" not in a.proc.log() + b.proc.log()


def test_restart_on_same_file_store_serves_prefix_from_l3(tmp_path: Path) -> None:
    pages = tmp_path / "pages"
    flags = [*L3_FLAGS, "--hicache-storage-backend", "file",
             "--hicache-storage-backend-extra-config", json.dumps({"path": str(pages)})]
    system = LONG_PROMPT
    turn1 = [{"role": "system", "content": system},
             {"role": "user", "content": "Which pier floods first?"}]

    def chat(srv: EngineServer, messages: list[dict[str, str]]) -> tuple[str, int, int]:
        out = srv.post("/v1/chat/completions", {"messages": messages, "max_tokens": 10,
                                                "temperature": 0})
        u = out["usage"]
        return (out["choices"][0]["message"]["content"], u["prompt_tokens"],
                u["prompt_tokens_details"]["cached_tokens"])

    first = EngineServer(tmp_path, flags, name="engine-1").start().wait_ready()
    try:
        reply1, p1, c1 = chat(first, turn1)
        assert c1 == 0
        # SIGTERM to the front end only (as a service manager sends it): both processes stop
        # cleanly, and the scheduler flushes its write-through to the file store first.
        sched = first.get("/get_model_info")["scheduler_pid"]
        os.kill(first.proc.pid, signal.SIGTERM)
        assert first.proc.proc is not None
        assert first.proc.proc.wait(timeout=120) == 0
        assert wait_gone(sched)
        assert "scheduler exited with 0" in first.proc.log()
    finally:
        first.proc.kill()
    second = EngineServer(tmp_path, flags, name="engine-2").start().wait_ready()
    try:
        again, p2, c2 = chat(second, turn1)
        assert (again, p2) == (reply1, p1)  # identical greedy output
        s = second.stats()
        assert s["storage_hit_tokens"] > 0 and s["device_hit_tokens"] == 0
        assert c2 == s["storage_hit_tokens"] == (p1 - 1) // PAGE * PAGE
        # The next turn builds on it (device hit now).
        turn2 = [*turn1, {"role": "assistant", "content": reply1},
                 {"role": "user", "content": "And the second?"}]
        _, p3, c3 = chat(second, turn2)
        assert c3 >= c2
        # Killing the front end (kill -9, not its process group) ends the scheduler too.
        sched = second.get("/get_model_info")["scheduler_pid"]
        assert pid_alive(sched)
        os.kill(second.proc.pid, signal.SIGKILL)
        assert second.proc.proc is not None
        second.proc.proc.wait(timeout=30)
        assert wait_gone(sched), "the scheduler outlived its front end"
    finally:
        second.proc.kill()


def test_killing_the_scheduler_ends_the_front_end(tmp_path: Path) -> None:
    srv = EngineServer(tmp_path, name="engine-kill").start().wait_ready()
    try:
        sched = srv.get("/get_model_info")["scheduler_pid"]
        os.kill(sched, signal.SIGKILL)
        assert srv.proc.proc is not None
        code = srv.proc.proc.wait(timeout=60)
        assert code == 1
        assert "the scheduler process exited with -9" in srv.proc.log()
        assert wait_gone(sched)
    finally:
        srv.proc.kill()
