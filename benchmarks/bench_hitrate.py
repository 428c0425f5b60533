"""Benchmark of `hicache-hitrate` against LMCache's cache simulator on the Mooncake trace.

Measures, on traces/mooncake_conversation_trace.jsonl (or `--trace`):

* requests/s replaying the trace through the real `HiRadixCache` (simulated mode, LRU, device
  only) at one capacity, and LMCache's simulator (`lmcache tool cache-simulator`'s `simulate`,
  both its fast LRU and the SortedList LRU its `simulate` command uses) at the same capacity;
* a 32-point miss-ratio curve: our one pass of stack distances against LMCache's sweep (one
  simulation per capacity, as `lmcache tool cache-simulator sweep` does);
* the LRU hit rates of both on the same trace converted to LMCache's lookup-hash log format
  (full 512-token chunks only, as LMCache logs them).

    python benchmarks/bench_hitrate.py [--quick] [--out benchmarks/results/bench_hitrate.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.hitrate import mrc  # noqa: E402
from tools.hitrate.pages import Layout  # noqa: E402
from tools.hitrate.simulate import TierConfig, replay  # noqa: E402
from tools.hitrate.traces import read_trace  # noqa: E402

DEFAULT_TRACE = REPO / "traces" / "mooncake_conversation_trace.jsonl"
BLOCK = 512
KV_BYTES_PER_CHUNK = 512 * 1024  # any value: capacities are given in chunks on both sides


def to_lmcache_log(trace_path: Path, out: Path, limit: int | None) -> int:
    """Mooncake -> LMCache lookup-hash JSONL: only full chunks have hashes (LMCache never
    stores a partial chunk), seq_len is the input length."""
    n = 0
    with open(trace_path) as src, open(out, "w") as dst:
        for line in src:
            if limit is not None and n >= limit:
                break
            r = json.loads(line)
            full = r["input_length"] // BLOCK
            ev = {
                "timestamp": r["timestamp"] / 1000.0,
                "request_id": f"r{n}",
                "model_name": "mooncake",
                "chunk_size": BLOCK,
                "seq_len": r["input_length"],
                "dtypes": ["int8"],
                "shapes": [[KV_BYTES_PER_CHUNK]],
                "chunk_hashes": [f"0x{h:x}" for h in r["hash_ids"][:full]],
            }
            dst.write(json.dumps(ev) + "\n")
            n += 1
    return n


def timed(fn: Any, *a: Any, **kw: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    r = fn(*a, **kw)
    return r, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--quick", action="store_true", help="first 2000 requests only")
    ap.add_argument(
        "--capacity-pages",
        type=int,
        default=20000,
        help="capacity of the one-configuration runs, in 512-token pages",
    )
    ap.add_argument("--points", type=int, default=32)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bench_hitrate.json"))
    args = ap.parse_args(argv)
    limit = 2000 if args.quick else None
    trace_path = Path(args.trace)
    if not trace_path.exists():
        print(f"trace not found: {trace_path}", file=sys.stderr)
        return 2
    cap = args.capacity_pages
    out: dict[str, Any] = {
        "trace": str(trace_path),
        "quick": args.quick,
        "capacity_pages": cap,
        "page_size": BLOCK,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }

    # --- ours, on the Mooncake trace itself -------------------------------------------------
    trace, t_read = timed(read_trace, trace_path, limit=limit)
    n = len(trace.requests)
    out["requests"] = n
    sim, t_sim = timed(replay, trace, TierConfig(page_size=BLOCK, device_pages=cap))
    paged, t_pages = timed(lambda: Layout(trace, BLOCK).all_paged())
    stack, t_stack = timed(mrc.stack_distances, paged, BLOCK)

    def curve() -> list[tuple[int, float]]:
        return [
            (c, stack.hit_tokens(c) / stack.input_tokens)
            for c in mrc.mrc_points(stack, args.points)
        ]

    points, t_curve = timed(curve)
    opt, t_opt = timed(mrc.belady, paged, BLOCK, cap)
    out["hicache_mooncake"] = {
        "read_s": t_read,
        "replay_s": t_sim,
        "replay_requests_per_s": n / t_sim,
        "replay_hit_rate": sim.hit_tokens / sim.input_tokens,
        "mrc_one_pass_s": t_pages + t_stack + t_curve,
        "mrc_requests_per_s": n / (t_pages + t_stack + t_curve),
        "mrc_points": [{"capacity_pages": c, "hit_rate": h} for c, h in points],
        "mrc_hit_rate_at_capacity": stack.hit_tokens(cap) / stack.input_tokens,
        "unbounded_hit_rate": stack.unbounded_hit_tokens / stack.input_tokens,
        "opt_hit_rate": opt.hit_tokens / stack.input_tokens,
        "opt_s": t_opt,
    }

    # --- the same trace as an LMCache lookup-hash log ---------------------------------------
    try:
        from lmcache.tools.cache_simulator.simulator import load_lookup_events, simulate
    except ImportError:
        out["lmcache"] = None
        print("lmcache is not installed: LMCache side skipped", file=sys.stderr)
    else:
        with tempfile.TemporaryDirectory() as d:
            log = Path(d) / "lookup_hashes_0.jsonl"
            to_lmcache_log(trace_path, log, limit)
            events, t_lm_load = timed(load_lookup_events, [log])
            lm_trace, t_our_load = timed(read_trace, log)
        bytes_cap = cap * KV_BYTES_PER_CHUNK
        lm_fast, t_lm_fast = timed(simulate, events, bytes_cap, KV_BYTES_PER_CHUNK, fast=True)
        lm_full, t_lm_full = timed(simulate, events, bytes_cap, KV_BYTES_PER_CHUNK, fast=False)
        caps = mrc.mrc_points(stack, args.points)

        def lm_sweep() -> list[float]:
            return [
                simulate(events, c * KV_BYTES_PER_CHUNK, KV_BYTES_PER_CHUNK, fast=True)[
                    "token_hit_rate"
                ]
                for c in caps
            ]

        lm_curve, t_lm_sweep = timed(lm_sweep)
        lm_paged, t_lm_pages = timed(lambda: Layout(lm_trace, BLOCK).all_paged())
        flat, t_flat = timed(mrc.stack_distances, lm_paged, BLOCK, order="flat")
        tree, t_tree = timed(mrc.stack_distances, lm_paged, BLOCK)
        ours_flat_curve = [flat.hit_tokens(c) / flat.input_tokens for c in caps]
        lm_sim, t_lm_replay = timed(replay, lm_trace, TierConfig(page_size=BLOCK, device_pages=cap))
        nl = len(events)
        out["lmcache"] = {
            "version": _lmcache_version(),
            "requests": nl,
            "load_s": t_lm_load,
            "simulate_fast_s": t_lm_fast,
            "simulate_fast_requests_per_s": nl / t_lm_fast,
            "simulate_report_s": t_lm_full,
            "sweep_s": t_lm_sweep,
            "sweep_points": len(caps),
            "hit_rate_at_capacity": lm_fast["token_hit_rate"],
            "hit_rate_at_capacity_report_mode": lm_full["token_hit_rate"],
            "unbounded_hit_rate": lm_curve[-1],
        }
        out["hicache_on_lmcache_log"] = {
            "read_s": t_our_load,
            "replay_s": t_lm_replay,
            "replay_requests_per_s": nl / t_lm_replay,
            "replay_hit_rate": lm_sim.hit_tokens / lm_sim.input_tokens,
            "tree_lru_mrc_hit_rate": tree.hit_tokens(cap) / tree.input_tokens,
            "flat_lru_hit_rate": flat.hit_tokens(cap) / flat.input_tokens,
            "flat_curve_equals_lmcache": all(
                abs(a - b) < 1e-12 for a, b in zip(ours_flat_curve, lm_curve)
            ),
            "mrc_one_pass_s": t_lm_pages + t_tree,
            "flat_mrc_one_pass_s": t_lm_pages + t_flat,
        }
        out["speed"] = {
            "mrc_32_points_vs_lmcache_sweep": t_lm_sweep / (t_lm_pages + t_tree),
            "one_config_replay_vs_lmcache_fast": t_lm_fast / t_lm_replay,
            "one_config_replay_vs_lmcache_report": t_lm_full / t_lm_replay,
            "note": "> 1: ours is faster. The one-configuration replay drives the real "
            "HiRadixCache (page ids, the tool's default replay mode); LMCache's simulator is a flat dict of chunk hashes.",
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


def _lmcache_version() -> str:
    try:
        from importlib.metadata import version

        return version("lmcache")
    except Exception:  # noqa: BLE001 - informational only
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
