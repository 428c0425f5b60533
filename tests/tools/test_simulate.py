"""Exact per-tier hit counts of the HiRadixCache replay on small hand-made traces.

Blocks are 16 tokens, one page each; every request carries whole blocks unless it says."""

from __future__ import annotations

from pathlib import Path

from tests.tools.conftest import mooncake_rows, write_jsonl
from tools.hitrate.simulate import SimResult, TierConfig, replay
from tools.hitrate.traces import read_trace

BS = 16


def run(tmp_path: Path, reqs: list[tuple[list[int], int]], **tiers: object) -> SimResult:
    tr = read_trace(write_jsonl(tmp_path / "t.jsonl", mooncake_rows(reqs, BS)), block_size=BS)
    return replay(tr, TierConfig(page_size=BS, **tiers))  # type: ignore[arg-type]


def test_device_only(tmp_path: Path) -> None:
    # 3 device pages. r2 needs a page: the LRU leaf [2] goes; r3 needs one: [3] goes.
    # r3's last block holds 4 tokens.
    r = run(tmp_path, [([0, 1], 0), ([0, 2], 0), ([0, 1, 3], 0), ([0, 2], 20)], device_pages=3)
    assert r.per_request_hits == [0, 16, 32, 16]
    assert (r.device_hit_tokens, r.host_hit_tokens, r.storage_hit_tokens) == (64, 0, 0)
    assert (r.requests, r.input_tokens, r.hit_requests) == (4, 32 + 32 + 48 + 20, 3)
    assert r.cache_stats["evicted_tokens"] == 32


def test_device_and_host(tmp_path: Path) -> None:
    # 2 device pages, 4 host pages, write-through: each 2-page prompt evicts the other one's
    # device copy, which stays on the host and is loaded back on the next use.
    reqs = [([0, 1], 0), ([2, 3], 0), ([0, 1], 0), ([2, 3], 0), ([0, 1], 0), ([0, 1], 0)]
    r = run(tmp_path, reqs, device_pages=2, host_pages=4)
    assert r.per_request_hits == [0, 0, 32, 32, 32, 32]
    assert (r.device_hit_tokens, r.host_hit_tokens, r.storage_hit_tokens) == (32, 96, 0)
    assert r.cache_stats["load_back_tokens"] == 96


def test_device_host_and_storage(tmp_path: Path) -> None:
    # 2 device pages, 4 host pages, unbounded storage. [0 1] leaves the host when [4 5] is
    # written through; r3 prefetches it from storage, r4 finds [4 5] on the host, r5 on device.
    reqs = [([0, 1], 0), ([2, 3], 0), ([4, 5], 0), ([0, 1], 0), ([4, 5], 0), ([4, 5], 0)]
    r = run(tmp_path, reqs, device_pages=2, host_pages=4, storage_pages=None, prefetch_threshold=0)
    assert r.per_request_hits == [0, 0, 0, 32, 32, 32]
    assert (r.device_hit_tokens, r.host_hit_tokens, r.storage_hit_tokens) == (32, 32, 32)
    assert r.cache_stats["prefetch_pages"] == 2


def test_storage_capacity_bounds_hits(tmp_path: Path) -> None:
    # Same trace, storage holds 2 pages: [0 1] was pushed out of L3 by later backups.
    reqs = [([0, 1], 0), ([2, 3], 0), ([4, 5], 0), ([0, 1], 0)]
    r = run(tmp_path, reqs, device_pages=2, host_pages=4, storage_pages=2, prefetch_threshold=0)
    assert r.per_request_hits == [0, 0, 0, 0]


def test_output_pages_take_device_room(tmp_path: Path) -> None:
    # Output tokens are inserted too (unique ids): 15 output tokens + the extra prompt token
    # make one more full page, which evicts [1] at 3 device pages.
    rows = mooncake_rows([([0, 1], 0), ([0, 1], 0)], BS, output=15)
    tr = read_trace(write_jsonl(tmp_path / "t.jsonl", rows), block_size=BS)
    r = replay(tr, TierConfig(page_size=BS, device_pages=3))
    assert r.per_request_hits == [0, 32]
    r = replay(tr, TierConfig(page_size=BS, device_pages=2))  # 3 pages do not fit: not cached
    assert r.per_request_hits == [0, 0]
    r = replay(tr, TierConfig(page_size=BS, device_pages=2), ignore_output=True)
    assert r.per_request_hits == [0, 32]


def test_smaller_pages_than_blocks(tmp_path: Path) -> None:
    # 4-token pages: a 16-token block is 4 pages; capacities are in pages.
    tr = read_trace(
        write_jsonl(tmp_path / "t.jsonl", mooncake_rows([([0, 1], 0), ([0, 2], 0)], BS)),
        block_size=BS,
    )
    r = replay(tr, TierConfig(page_size=4, device_pages=8))
    assert r.per_request_hits == [0, 16]


def test_engine_trace_counts_real_tokens(tmp_path: Path) -> None:
    rows = [
        {
            "ts": 0,
            "rid": "a",
            "input_ids": list(range(10)),
            "output_ids": [50, 51],
            "extra_key": None,
            "cached_tokens": 0,
        },
        # a follow-up turn: prompt = previous prompt + output + new tokens
        {
            "ts": 1,
            "rid": "b",
            "input_ids": [*range(10), 50, 51, 60, 61],
            "output_ids": [],
            "extra_key": None,
            "cached_tokens": 12,
        },
        # same tokens, another tenant: nothing shared
        {
            "ts": 2,
            "rid": "c",
            "input_ids": list(range(10)),
            "output_ids": [],
            "extra_key": "other",
            "cached_tokens": 0,
        },
    ]
    tr = read_trace(write_jsonl(tmp_path / "e.jsonl", rows))
    r = replay(tr, TierConfig(page_size=4, device_pages=64))
    assert r.per_request_hits == [0, 12, 0]
    assert r.engine_cached_tokens == 12 and r.engine_mismatched_requests == 0
