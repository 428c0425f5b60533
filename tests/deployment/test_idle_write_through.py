"""An idle engine's write-through reaches the shared L3 by itself: engine A serves a long prompt
and is then left alone (nothing asks it anything); the store fills up anyway, and engine B,
started afterwards with default settings, serves the prompt from L3 with A's greedy output."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.deployment.cluster import LONG_PROMPT, PAGE, generate, l3_flags, wait_store_pages
from tests.engine.test_server_api import EngineServer
from tests.storage_backends.hicache_server_proc import HiCacheServerProc

pytestmark = pytest.mark.slow


def test_idle_engine_backs_up_to_l3_and_another_engine_reads_it(tmp_path: Path) -> None:
    store = HiCacheServerProc(tmp_path, capacity="256MiB").start()
    a = b = None
    try:
        a = EngineServer(tmp_path, l3_flags(store), name="engine-a").start().wait_ready()
        out_a = generate(a.url, LONG_PROMPT)
        served_at = time.monotonic()
        prompt_tokens = out_a["meta_info"]["prompt_tokens"]
        assert 1500 <= prompt_tokens <= 1700
        assert out_a["meta_info"]["cached_tokens"] == 0
        # Every full page of prompt + output but the last token reaches the store, although A
        # receives no request (not even a stats query) after its answer.
        full_pages = (prompt_tokens + len(out_a["output_ids"]) - 1) // PAGE
        assert wait_store_pages(store, full_pages) == full_pages
        b_flags = l3_flags(store)  # default settings (the `timeout` prefetch policy)
        b = EngineServer(tmp_path, b_flags, name="engine-b").start().wait_ready()
        time.sleep(max(0.0, 2.0 - (time.monotonic() - served_at)))  # B asks >= 2 s after A
        out_b = generate(b.url, LONG_PROMPT)
        assert out_b["output_ids"] == out_a["output_ids"]
        sb = b.stats()
        assert sb["storage_hit_tokens"] == out_b["meta_info"]["cached_tokens"]
        # `timeout` takes what arrived within its budget: all of it unless the machine stalls.
        assert 0 < sb["storage_hit_tokens"] <= (prompt_tokens - 1) // PAGE * PAGE
        assert sb["storage_hit_tokens"] % PAGE == 0
        assert sb["device_hit_tokens"] == 0 and sb["corrupt_pages"] == 0
        # B's cost model has measured the L3 read it made (and the prefill that followed).
        cost = sb["cost_model"]
        assert cost["storage_samples"] >= 1 and cost["storage_bytes_per_s"] > 0
        assert cost["prefill_tokens_per_s"] > 0 and cost["bytes_per_token"] > 0
        # A's own counters agree with the store (asked only now).
        sa = a.stats()
        assert sa["storage_backup_pages"] == full_pages and sa["storage_errors"] == 0
    finally:
        for e in (a, b):
            if e is not None:
                e.stop()
        store.stop()
    assert "Traceback" not in a.proc.log() + b.proc.log()
