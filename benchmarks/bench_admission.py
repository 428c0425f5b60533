"""L3 admission on the Mooncake conversation trace: hit rate and L3 write volume of `always`,
`reuse:2` and `frequency` side by side (issue 47), through the core's simulated HiRadixCache
(the replay hicache-hitrate runs: a cache of page size 1 over the trace's block ids), and the
same decisions checked on a slice through a real (tensor, synchronous) HiRadixCache with the
in-process memory backend.

Each request looks up and inserts its `hash_ids` (one 512-token block a page). Device and host
are sized as fractions of the trace's distinct blocks; L3 is unbounded or capped.

    .venv/bin/python benchmarks/bench_admission.py --out benchmarks/results/admission-2026-12-07/
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from hicache.config import HiCacheConfig
from hicache.hiradix import HiRadixCache
from hicache.simulation import SimStorage, replay_request

TRACE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_conversation_trace.jsonl"
BLOCK_TOKENS = 512
# KV bytes of one 512-token block of Llama-3.1-8B in bf16 (2 x 32 layers x 8 heads x 128 x 2 B).
BLOCK_BYTES = 2 * 32 * 8 * 128 * 2 * BLOCK_TOKENS
POLICIES = ("always", "reuse:2", "frequency")


def load(limit: int | None) -> list[dict[str, Any]]:
    out = []
    with open(TRACE) as f:
        for line in f:
            out.append(json.loads(line))
            if limit is not None and len(out) >= limit:
                break
    return out


def config(policy: str, **kw: Any) -> HiCacheConfig:
    return HiCacheConfig(page_size=1, storage_admission=policy, prefetch_threshold=0,
                         load_back_threshold=0, **kw)


def replay(cache: HiRadixCache, trace: list[dict[str, Any]]) -> dict[str, Any]:
    for i, r in enumerate(trace):
        ids = r["hash_ids"]
        replay_request(cache, str(i), ids, ids, input_tokens=len(ids))
    cache.flush()
    s = cache.stats
    pages = s.input_tokens
    return {
        "requests": s.requests,
        "hit_rate": round(s.hit_tokens / pages, 6) if pages else 0.0,
        "device_hit_pages": s.device_hit_tokens,
        "host_hit_pages": s.host_hit_tokens,
        "storage_hit_pages": s.storage_hit_tokens,
        "l3_pages_written": s.storage_backup_pages,
        "l3_bytes_written": s.storage_backup_pages * BLOCK_BYTES,
        "declined_pages": s.storage_declined_pages,
        "declined_rehit_pages": s.storage_declined_rehit_pages,
    }


def simulated(policy: str, trace: list[dict[str, Any]], device: int, host: int,
              l3: int | None) -> dict[str, Any]:
    cache = HiRadixCache(config(policy, simulated=True), num_device_pages=device,
                         num_host_pages=host, sim_storage=SimStorage(l3))
    t0 = time.perf_counter()
    out = replay(cache, trace)
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def real(policy: str, trace: list[dict[str, Any]], device: int, host: int) -> dict[str, Any]:
    import torch

    from hicache.memory_backend import MemoryBackend
    from hicache.pools import DeviceKVPool
    from hicache_client.backend import StorageConfig

    pool = DeviceKVPool(num_pages=device, page_size=1, num_layers=1, kv_heads=1, head_dim=4,
                        dtype=torch.float32)
    cache = HiRadixCache(config(policy, synchronous=True), device_pool=pool,
                         num_host_pages=host, storage=MemoryBackend(StorageConfig()))
    try:
        return replay(cache, trace)
    finally:
        cache.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=None, help="first N requests (all)")
    ap.add_argument("--device-share", type=float, default=0.02,
                    help="device pages as a share of the distinct blocks")
    ap.add_argument("--host-ratio", type=float, default=2.0)
    ap.add_argument("--l3-share", type=float, default=0.25,
                    help="capped L3 as a share of the distinct blocks (besides unbounded)")
    ap.add_argument("--check-requests", type=int, default=1500,
                    help="slice replayed through the real cache too (0: none)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    trace = load(args.requests)
    distinct = len({h for r in trace for h in r["hash_ids"]})
    device = max(64, int(distinct * args.device_share))
    host = int(device * args.host_ratio)
    l3_cap = int(distinct * args.l3_share)
    rows = []
    for l3 in (None, l3_cap):
        for p in POLICIES:
            row = {"policy": p, "l3_pages": l3, **simulated(p, trace, device, host, l3)}
            rows.append(row)
    base = {r["l3_pages"]: r for r in rows if r["policy"] == "always"}
    for r in rows:
        b = base[r["l3_pages"]]
        r["hit_rate_vs_always"] = round(r["hit_rate"] - b["hit_rate"], 6)
        r["l3_write_ratio_vs_always"] = round(
            r["l3_pages_written"] / b["l3_pages_written"], 4) if b["l3_pages_written"] else None
    checks = []
    if args.check_requests:
        sl = trace[: args.check_requests]
        sdist = len({h for r in sl for h in r["hash_ids"]})
        sdev = max(64, int(sdist * args.device_share))
        for p in POLICIES:
            a = simulated(p, sl, sdev, int(sdev * args.host_ratio), None)
            b = real(p, sl, sdev, int(sdev * args.host_ratio))
            a.pop("seconds")
            checks.append({"policy": p, "requests": len(sl), "equal": a == b, "simulated": a,
                           "real": b})
    doc = {
        "bench": "admission",
        "trace": TRACE.name,
        "requests": len(trace),
        "distinct_blocks": distinct,
        "block_tokens": BLOCK_TOKENS,
        "block_bytes": BLOCK_BYTES,
        "device_pages": device,
        "host_pages": host,
        "l3_capped_pages": l3_cap,
        "loadavg": os.getloadavg(),
        "rows": rows,
        "real_vs_simulated": checks,
        "notes": "exclusive tiering was not built (see docs/retention.md); the real cache is "
                 "the tensor HiRadixCache with the memory backend, not the whole engine",
    }
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_admission.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
