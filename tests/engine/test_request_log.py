"""The request log: one JSON line per finished request; replaying it through
`hicache.simulation.simulate_request` reproduces the engine's counters (requests run one at a
time)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.engine import Engine
from hicache.config import HiCacheConfig
from hicache.hiradix import HiRadixCache
from hicache.simulation import SimStorage, simulate_request
from tests.engine.workload import make_sessions, run_sessions

COUNTERS = ("requests", "input_tokens", "device_hit_tokens", "host_hit_tokens",
            "storage_hit_tokens", "evicted_tokens")


def _replay(log: Path, cfg: HiCacheConfig, device_pages: int, host_pages: int,
            storage: bool) -> tuple[list[int], dict[str, Any]]:
    sim = HiRadixCache(cfg, num_device_pages=device_pages, num_host_pages=host_pages,
                       sim_storage=SimStorage() if storage else None)
    cached = []
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        r = simulate_request(sim, rec["rid"], rec["input_ids"], rec["output_ids"],
                             extra_key=rec["extra_key"])
        cached.append(r.cached_tokens)
    return cached, sim.stats.as_dict()


@pytest.mark.parametrize("mode", ["device", "hierarchical"])
def test_replay_reproduces_engine_counters(tiny_model: Path, tmp_path: Path, mode: str) -> None:
    log = tmp_path / "requests.jsonl"
    kw: dict[str, Any] = {}
    host_pages = 0
    if mode == "hierarchical":
        kw = {
            "enable_hierarchical_cache": True,
            "hicache_ratio": 1.0,
            "hicache_synchronous": True,
            "hicache_storage_backend": "memory",
            "hicache_storage_backend_extra_config": {"prefetch_threshold": 8},
        }
        host_pages = 64
    sessions = make_sessions(12, seed=11, turns=(2, 4), user_len=(6, 20))
    with Engine(model_path=str(tiny_model), page_size=4, max_total_tokens=256,
                request_log=str(log), **kw) as e:
        run_sessions(e, sessions, batch=False)
        stats = e.cache_stats()
        cfg = e.args.to_hicache_config()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(lines) == stats["requests"] == sum(len(s.users) for s in sessions)
    first = lines[0]
    assert set(first) == {"ts", "rid", "input_ids", "output_ids", "extra_key", "cached_tokens",
                          "cache_outcomes"}
    # Each request's attribution sums to its prompt; together they are the engine's counters.
    total: dict[str, int] = {}
    for x in lines:
        assert sum(x["cache_outcomes"].values()) == len(x["input_ids"])
        for k, v in x["cache_outcomes"].items():
            total[k] = total.get(k, 0) + v
    assert total == {k: v for k, v in stats["prompt_outcomes"].items() if v}
    assert isinstance(first["ts"], float) and first["extra_key"] is None
    sim_cfg = HiCacheConfig(**{**cfg.__dict__, "simulated": True, "storage_backend": None,
                               "storage_extra_config": {}})
    cached, sim_stats = _replay(log, sim_cfg, 256 // 4, host_pages, mode == "hierarchical")
    assert cached == [x["cached_tokens"] for x in lines]
    assert {k: sim_stats[k] for k in COUNTERS} == {k: stats[k] for k in COUNTERS}
    assert sim_stats["prompt_outcomes"] == stats["prompt_outcomes"]  # predicted == measured
    assert stats["evicted_tokens"] > 0
    if mode == "hierarchical":
        assert stats["host_hit_tokens"] + stats["storage_hit_tokens"] > 0
