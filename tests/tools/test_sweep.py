"""Sweeps: size lists and ranges, several eviction policies side by side, --warmup; every row is
the exact replay of its configuration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache_client.errors import ConfigError
from tests.tools.conftest import prefix_trace
from tools.hitrate.cli import main
from tools.hitrate.sweep import parse_sizes

GiB = 2**30


def test_parse_sizes_lists_and_ranges() -> None:
    assert parse_sizes("8GiB,16GiB", "--d") == [("bytes", 8 * GiB), ("bytes", 16 * GiB)]
    assert parse_sizes("4GiB:64GiB:x2", "--d") == [("bytes", float(4 * GiB << k)) for k in range(5)]
    assert parse_sizes("0,1024p:4096p:+1024p,unbounded,0", "--d") == [
        ("tokens", 0), ("pages", 1024), ("pages", 2048), ("pages", 3072), ("pages", 4096), None]
    assert parse_sizes("4096", "--d") == [("tokens", 4096)]


@pytest.mark.parametrize(
    ("text", "msg"),
    [
        ("4GiB:64GiB", "must be START:STOP"),
        ("4GiB:64p:x2", "same unit"),
        ("4GiB:64GiB:x1", "factor > 1"),
        ("4GiB:64GiB:y2", "xFACTOR or \\+STEP"),
        ("64GiB:4GiB:x2", "is empty"),
        ("1p:1000000p:+1p", "more than 10000"),
        ("8GiB,,16GiB", "empty size"),
        ("8Gox", "--host: bad size"),
    ],
)
def test_parse_sizes_errors(text: str, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        parse_sizes(text, "--host")


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return prefix_trace(tmp_path / "t.jsonl", seed=7, requests=150, roots=6, max_blocks=6,
                        one_offs=True)


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main([*argv, "--json", "--no-progress", "--no-opt"]) == 0
    return json.loads(capsys.readouterr().out)


def test_sweep_rows_are_the_exact_replays(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = [str(trace), "--block-size", "16", "--prefill-tokens-per-s", "1000",
            "--kv-bytes-per-token", "1024", "--host-bandwidth", "1e6"]
    doc = run_json(capsys, [*base, "--device", "4p:16p:x2", "--host", "0,32p",
                            "--eviction-policy", "lru,fifo", "--warmup", "0.2"])
    rows = doc["sweep"]
    assert [(r["eviction_policy"], r["device_pages"], r["host_pages"]) for r in rows] == [
        (p, d, h) for p in ("lru", "fifo") for d in (4, 8, 16) for h in (0, 32)]
    # the main report is the first point
    assert doc["result"]["hit_tokens"] == rows[0]["hit_tokens"]
    assert doc["config"]["warmup"] == 0.2 and doc["result"]["requests"] == 300 - 60
    for r in rows:
        one = run_json(capsys, [*base, "--device", f"{r['device_pages']}p", "--host",
                                f"{r['host_pages']}p", "--eviction-policy",
                                r["eviction_policy"], "--warmup", "0.2"])
        res = one["result"]
        assert (r["hit_tokens"], r["device_hit_tokens"], r["host_hit_tokens"]) == (
            res["hit_tokens"], res["device_hit_tokens"], res["host_hit_tokens"])
        assert r["ttft_saved_seconds"] == one["savings"]["ttft_saved_seconds"]
        assert r["device_bytes"] == r["device_pages"] * 16 * 1024
    hits = [r["hit_tokens"] for r in rows if r["host_pages"] == 0 and r["eviction_policy"] == "lru"]
    assert hits == sorted(hits) and hits[0] < hits[-1]
    assert any(r["host_hit_tokens"] > 0 for r in rows)


def test_warmup_counts_only_the_steady_state(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = run_json(capsys, [str(trace), "--block-size", "16", "--device", "8p"])
    warm = run_json(capsys, [str(trace), "--block-size", "16", "--device", "8p",
                             "--warmup", "0.5"])
    assert full["result"]["requests"] == 300 and warm["result"]["requests"] == 150
    assert warm["unbounded"]["hit_tokens"] <= full["unbounded"]["hit_tokens"]
    assert warm["result"]["input_tokens"] == warm["trace"]["input_tokens"]
    assert warm["sweep"] is None
    for bad in ("1", "-0.1"):
        assert main([str(trace), "--block-size", "16", "--warmup", bad]) == 2
        assert "--warmup must be a fraction" in capsys.readouterr().err
    assert main([str(trace), "--eviction-policy", "lru,lru"]) == 2
    assert "bad list" in capsys.readouterr().err
