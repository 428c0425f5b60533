"""`hicache-engine --tp-size 2` over HTTP: two tensor-parallel servers on one real
`hicache-server` (a prefix computed by A is read from L3 by both of B's ranks), outputs equal to
the TP=1 engine, per-rank stats, and no rank process outliving its scheduler."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from tests.engine.test_server_api import pid_alive, wait_gone
from tests.engine.test_server_multi import LONG_PROMPT, PAGE, engines_on_one_store, generate

pytestmark = pytest.mark.slow

# One GPU per rank: with fewer than two, both ranks (and the reference) run on the CPU.
TP_DEVICE = "auto" if torch.cuda.device_count() >= 2 else "cpu"
TP_FLAGS = ["--tp-size", "2", "--enable-tp-state-check", "--dist-timeout", "60",
            "--device", TP_DEVICE]


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def test_tp2_servers_share_l3_and_match_tp1(tmp_path: Path) -> None:
    with engines_on_one_store(tmp_path, TP_FLAGS, ("tp-a", "tp-b"), kill=True) as (a, b):
        out_a = generate(a, LONG_PROMPT)
        prompt_tokens = out_a["meta_info"]["prompt_tokens"]
        sa = a.wait_transfers()
        assert [r["rank"] for r in sa["ranks"]] == [0, 1]
        # Each rank backed up its own shard of every full page, under its own keys.
        want = (prompt_tokens - 1) // PAGE
        backups = [{k: r[k] for k in ("storage_backup_pages", "storage_backup_skipped_pages",
                                      "storage_failed_pages", "backup_skipped_tokens")}
                   for r in sa["ranks"]]
        assert all(b["storage_backup_pages"] >= want for b in backups), (want, backups)
        out_b = generate(b, LONG_PROMPT)
        assert out_b["output_ids"] == out_a["output_ids"]
        sb = b.stats()
        hit = want * PAGE
        assert out_b["meta_info"]["cached_tokens"] == hit
        assert [r["storage_hit_tokens"] for r in sb["ranks"]] == [hit, hit]
        assert all(r["storage"]["get_hits"] >= want for r in sb["ranks"])
        assert all(r["corrupt_pages"] == 0 for r in sb["ranks"])
        # The same tokens as one rank with no cache at all.
        with Engine(disable_radix_cache=True, max_total_tokens=16384, device=TP_DEVICE) as ref:
            expect = ref.generate(input_ids=ref.tokenizer.encode(LONG_PROMPT),
                                  sampling_params={"max_new_tokens": 12, "ignore_eos": True})
        assert out_a["output_ids"] == expect[0]["output_ids"]
        # Killing the scheduler (rank 0) ends its other rank too: no orphan holds the devices.
        sched = b.get("/get_model_info")["scheduler_pid"]
        ranks = _children(sched)
        assert len(ranks) >= 1 and all(pid_alive(p) for p in ranks)
        os.kill(sched, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(pid_alive(p) for p in ranks):
            time.sleep(0.2)
        assert not any(pid_alive(p) for p in ranks), "a tp rank outlived its scheduler"
        assert wait_gone(sched)
    assert "Traceback" not in a.proc.log()
