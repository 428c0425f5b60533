"""Page-id replay (page size 1 over page ids) makes exactly the decisions of token replay."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tools.hitrate.simulate import TierConfig, replay
from tools.hitrate.traces import read_trace

BS = 16


def block_trace(tmp_path: Path, seed: int, n: int = 120) -> Path:
    rng = random.Random(seed)
    p = tmp_path / f"mc{seed}.jsonl"
    with open(p, "w") as f:
        for i in range(n):
            prefix = [0, rng.randrange(3)] if rng.random() < 0.8 else []
            blocks = prefix + [rng.randrange(40) for _ in range(rng.randrange(0, 6))]
            blocks = blocks or [rng.randrange(40)]
            inp = len(blocks) * BS - rng.randrange(BS)
            f.write(json.dumps({"timestamp": i, "input_length": inp,
                                "output_length": rng.randrange(0, 40), "hash_ids": blocks}) + "\n")
    return p


def engine_trace(tmp_path: Path, seed: int, n: int = 80) -> Path:
    rng = random.Random(seed)
    p = tmp_path / f"eng{seed}.jsonl"
    with open(p, "w") as f:
        for i in range(n):
            sys_prompt = [1] * rng.choice([8, 16, 24])
            prompt = sys_prompt + [rng.randrange(5) for _ in range(rng.randrange(1, 30))]
            out = [rng.randrange(5) for _ in range(rng.randrange(0, 10))]
            f.write(json.dumps({"ts": float(i), "rid": f"r{i}", "input_ids": prompt,
                                "output_ids": out, "extra_key": rng.choice([None, "t"]),
                                "cached_tokens": 0}) + "\n")
    return p


TIERS = [
    dict(device_pages=6),
    dict(device_pages=6, host_pages=12, write_policy="write_back"),
    dict(device_pages=5, host_pages=10, storage_pages=30, write_policy="write_through_selective"),
    dict(device_pages=4, host_pages=8, storage_pages=None, eviction_policy="lfu",
         prefetch_threshold=20, load_back_threshold=12),
    dict(device_pages=6, host_pages=6, storage_pages=None, eviction_policy="slru"),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tiers", TIERS)
@pytest.mark.parametrize("page_size", [4, 16])
def test_block_trace_modes_agree(tmp_path, seed, tiers, page_size):
    tr = read_trace(block_trace(tmp_path, seed), block_size=BS)
    a = replay(tr, TierConfig(page_size=page_size, **tiers), mode="pages")
    b = replay(tr, TierConfig(page_size=page_size, **tiers), mode="tokens")
    assert a.per_request_hits == b.per_request_hits
    assert (a.device_hit_tokens, a.host_hit_tokens, a.storage_hit_tokens) == (
        b.device_hit_tokens, b.host_hit_tokens, b.storage_hit_tokens)
    assert a.cache_stats["evicted_tokens"] == b.cache_stats["evicted_tokens"]
    assert a.cache_stats["load_back_tokens"] == b.cache_stats["load_back_tokens"]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tiers", TIERS)
def test_token_trace_modes_agree(tmp_path, seed, tiers):
    tr = read_trace(engine_trace(tmp_path, seed))
    a = replay(tr, TierConfig(page_size=4, **tiers), mode="pages")
    b = replay(tr, TierConfig(page_size=4, **tiers), mode="tokens")
    assert a.per_request_hits == b.per_request_hits
    assert (a.device_hit_tokens, a.host_hit_tokens, a.storage_hit_tokens) == (
        b.device_hit_tokens, b.host_hit_tokens, b.storage_hit_tokens)
    assert a.hit_tokens > 0
