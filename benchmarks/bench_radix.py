"""Radix-tree throughput: match + insert (pages/s) replaying the Mooncake conversation trace.

Each request's `hash_ids` become its pages (one page per hash_id; with --page-size P each page
holds P synthetic tokens derived from the hash_id). The cache runs in simulated mode, so this
measures the tree, the policies and the bookkeeping, not memory copies.

    python benchmarks/bench_radix.py [--trace PATH] [--page-sizes 1 16 64] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hicache.config import HiCacheConfig  # noqa: E402
from hicache.hiradix import HiRadixCache  # noqa: E402

DEFAULT_TRACE = ROOT / "traces" / "mooncake_conversation_trace.jsonl"


def load(path: Path, limit: int | None) -> list[list[int]]:
    out = []
    with open(path) as f:
        for line in f:
            out.append(json.loads(line)["hash_ids"])
            if limit and len(out) >= limit:
                break
    return out


def expand(hash_ids: list[int], page_size: int) -> list[int]:
    if page_size == 1:
        return hash_ids
    toks: list[int] = []
    for h in hash_ids:
        base = (h * page_size) & 0x7FFFFFFF
        toks.extend(range(base, base + page_size))
    return toks


def run_once(requests: list[list[int]], page_size: int, capacity_pages: int,
             policy: str) -> dict[str, float]:
    cache = HiRadixCache(
        HiCacheConfig(page_size=page_size, simulated=True, eviction_policy=policy,
                      write_policy="write_through"),
        num_device_pages=capacity_pages,
        num_host_pages=capacity_pages * 2,
    )
    seqs = [expand(h, page_size) for h in requests]
    pages = sum(len(h) for h in requests)
    t0 = time.perf_counter()
    for s in seqs:
        cache.match_prefix(s)
    t_match = time.perf_counter() - t0
    t0 = time.perf_counter()
    for s in seqs:
        acq = cache.acquire(s)
        need = len(s) // page_size - len(acq.device_pages)
        new = cache.alloc_device(need) if need > 0 else []
        if new is not None:
            cache.insert(s, acq.device_pages + new)
        cache.release(acq.node)
    t_serve = time.perf_counter() - t0
    return {
        "match_pages_per_s": pages / t_match,
        "acquire_insert_pages_per_s": pages / t_serve,
        "requests_per_s": len(seqs) / t_serve,
        "hit_rate": cache.stats.hit_rate,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL trace")
    p.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16, 64],
                   help="tokens per page to measure (each hash_id is one page)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--capacity-pages", type=int, default=20000,
                   help="device pages (host gets twice as many); eviction runs when full")
    p.add_argument("--policy", default="lru", help="eviction policy")
    p.add_argument("--repeat", type=int, default=3, help="runs per page size; medians reported")
    p.add_argument("--quick", action="store_true", help="first 2000 requests, 1 repeat")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/bench_radix.json")
    a = p.parse_args(argv)
    if a.quick:
        a.limit, a.repeat = a.limit or 2000, 1
    if not a.trace.exists():
        print(f"trace not found: {a.trace}", file=sys.stderr)
        return 2
    reqs = load(a.trace, a.limit)
    results = []
    for ps in a.page_sizes:
        runs = [run_once(reqs, ps, a.capacity_pages, a.policy) for _ in range(a.repeat)]
        row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        row.update(page_size=ps, requests=len(reqs), pages=sum(map(len, reqs)), repeat=a.repeat)
        results.append(row)
        print(f"page_size={ps:3d}  match {row['match_pages_per_s']:12,.0f} pages/s   "
              f"acquire+insert {row['acquire_insert_pages_per_s']:12,.0f} pages/s   "
              f"{row['requests_per_s']:9,.0f} req/s   hit rate {row['hit_rate']:.3f}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"benchmark": "radix", "policy": a.policy,
                                 "capacity_pages": a.capacity_pages, "results": results}, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
