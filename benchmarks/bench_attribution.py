"""The cost of miss attribution (issue 48) on the engine's request path, on against off, in one
run, alternating so both see the same load:

- `cache`: the cache calls of one request as the scheduler makes them (prefetch, acquire,
  alloc, insert, release) on a real (tensor, synchronous) HiRadixCache with the in-process
  memory L3, page size 16, over shared-prefix prompts sized so the device pool churns (every
  eviction feeds the sketch, many lookups miss and are attributed);
- `engine`: `Engine.generate` of the demo model (CPU), one prompt at a time, 1 new token: the
  whole request path, with the attribution switched per pass (`cache.evicted` None = off), the
  cache flushed before each pass so both modes see the same hits and misses.

Medians of `--rounds` rounds of `--requests` requests each; the ratio is on / off.

    .venv/bin/python benchmarks/bench_attribution.py --out benchmarks/results/attribution-2026-12-07/
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

from hicache.attribution import EvictedSketch
from hicache.config import HiCacheConfig
from hicache.hiradix import HiRadixCache
from hicache.memory_backend import MemoryBackend
from hicache.pools import DeviceKVPool
from hicache_client.backend import StorageConfig

PS = 16


def prompts(n: int, seed: int, vocab: int = 30000) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(PS * rng.choice([8, 16]))] for _ in range(6)]
    out = []
    for _ in range(n):
        base = rng.choice(systems) if rng.random() < 0.7 else []
        out.append(base + [rng.randrange(vocab) for _ in range(PS * rng.randrange(2, 12) + 3)])
    return out


def make_cache(on: bool) -> HiRadixCache:
    cfg = HiCacheConfig(page_size=PS, synchronous=True, prefetch_threshold=0,
                        load_back_threshold=0, miss_attribution=on)
    pool = DeviceKVPool(num_pages=96, page_size=PS, num_layers=2, kv_heads=2, head_dim=8)
    return HiRadixCache(cfg, device_pool=pool, num_host_pages=160,
                        storage=MemoryBackend(StorageConfig()))


def cache_round(c: HiRadixCache, reqs: list[list[int]]) -> float:
    t0 = time.perf_counter()
    for i, t in enumerate(reqs):
        rid = str(i)
        c.prefetch(rid, t)
        acq = c.acquire(t, request_id=rid)
        need = len(t) // PS - len(acq.device_pages)
        new = c.alloc_device(need) if need > 0 else []
        assert new is not None
        c.insert(t, list(acq.device_pages) + new)
        c.release(acq.node)
    return (time.perf_counter() - t0) / len(reqs)


def bench_cache(rounds: int, n: int) -> dict[str, Any]:
    caches = {"on": make_cache(True), "off": make_cache(False)}
    for c in caches.values():
        cache_round(c, prompts(n, seed=999))  # warm-up (not timed)
    times: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(rounds):
        reqs = prompts(n, seed=r)
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            times[mode].append(cache_round(caches[mode], reqs))
    st = caches["on"].stats
    return {
        "requests_per_round": n, "rounds": rounds,
        "median_us_per_request": {k: statistics.median(v) * 1e6 for k, v in times.items()},
        "ratio_on_off": statistics.median(times["on"]) / statistics.median(times["off"]),
        "attribution_on": {k: v for k, v in st.prompt_outcomes.items() if v},
        "sketch_pages": len(caches["on"].evicted or ()),
    }


def bench_engine(rounds: int, n: int) -> dict[str, Any]:
    from engine.demo_model import ensure_demo_model
    from engine.engine import Engine

    path = ensure_demo_model()
    times: dict[str, list[float]] = {"on": [], "off": []}
    with Engine(model_path=str(path), page_size=PS, max_total_tokens=2048,
                enable_hierarchical_cache=True, hicache_synchronous=True) as e:
        sketch = e.cache.evicted
        for t in prompts(n, seed=99, vocab=200):  # warm-up (not timed)
            e.generate(input_ids=t, sampling_params={"max_new_tokens": 1})
        for r in range(rounds):
            reqs = prompts(n, seed=100 + r, vocab=200)
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                e.cache.evicted = sketch if mode == "on" else None
                assert e.flush_cache()  # both passes start from an empty cache, same prompts
                t0 = time.perf_counter()
                for t in reqs:
                    e.generate(input_ids=t, sampling_params={"max_new_tokens": 1})
                times[mode].append((time.perf_counter() - t0) / n)
        st = e.cache_stats()
    return {
        "requests_per_round": n, "rounds": rounds,
        "median_ms_per_request": {k: statistics.median(v) * 1e3 for k, v in times.items()},
        "ratio_on_off": statistics.median(times["on"]) / statistics.median(times["off"]),
        "prompt_outcomes": {k: v for k, v in st["prompt_outcomes"].items() if v},
    }


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import host, save_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--engine-requests", type=int, default=40)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    report = {
        "benchmark": "bench_attribution",
        "host": host(),
        "load_average": os.getloadavg(),
        "cache": bench_cache(a.rounds, a.requests),
        "engine": bench_engine(max(2, a.rounds // 2), a.engine_requests),
        "sketch_bound_pages": EvictedSketch().capacity,
    }
    report["load_average_after"] = os.getloadavg()
    if a.out:
        save_json(os.path.join(a.out, "bench_attribution.json"), report)
    import json

    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
