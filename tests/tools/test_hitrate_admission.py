"""hicache-hitrate --admission: the engine's L3 admission through the same core code, the L3
write volume beside the hit rate (issue 47)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tools.conftest import mooncake_rows, write_jsonl
from tools.hitrate.cli import main


def run(capsys: pytest.CaptureFixture[str], trace: Path, *extra: str) -> dict:
    assert main([str(trace), "--block-size", "16", "--page-size", "16", "--device", "8p",
                 "--host", "16p", "--storage", "unbounded", "--kv-bytes-per-token", "2",
                 "--prefetch-threshold", "0", "--load-back-threshold", "0", "--json",
                 "--no-progress", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_reuse_2_writes_a_prompt_after_its_third_send(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    ids = [1, 2, 3, 4]
    for sends, want in ((1, 0), (2, 0), (3, 4)):
        trace = write_jsonl(tmp_path / f"t{sends}.jsonl", mooncake_rows([(ids, 0)] * sends, 16))
        doc = run(capsys, trace, "--admission", "reuse:2")
        r = doc["result"]
        assert r["l3_pages_written"] == want, sends
        assert r["l3_bytes_written"] == want * 16 * 2
        assert doc["config"]["admission"] == "reuse:2"
        assert doc["config"]["replay_engine"] == "hiradix"
    always = run(capsys, trace)["result"]
    assert always["l3_pages_written"] == 4 and always["l3_pages_declined"] == 0
    assert r["l3_pages_declined"] == 8  # at the first backup and the second send's hit


def test_bad_admission_exit_2(tmp_path: Path) -> None:
    trace = write_jsonl(tmp_path / "t.jsonl", mooncake_rows([([1, 2], 0)], 16))
    assert main([str(trace), "--block-size", "16", "--admission", "reuse:0"]) == 2
