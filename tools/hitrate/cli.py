"""`hicache-hitrate TRACE [options]`: cache hit-rate analysis of a request trace.

Replays the trace through the real `HiRadixCache` in simulated mode and adds one-pass analyses
(LRU miss-ratio curve, Belady's optimum, reuse distances, prefix sharing). See docs/hitrate.md.
Exit status: 0 done, 2 bad input or options.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import asdict
from typing import Any

from hicache_client.errors import ConfigError
from tools.hitrate.cost import ttft_saved
from tools.hitrate.inputs import kv_bytes_option, read_arrays, run_command, storage_kv_bytes
from tools.hitrate.options import build_parser
from tools.hitrate.sizes import to_pages
from tools.hitrate.sweep import parse_sizes, run_sweep

logger = logging.getLogger(__name__)

def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _compiled_unfit(tiers: Any, args: argparse.Namespace, fmt: str) -> str:
    """Why the compiled replay would not be exact for this configuration ('' when it is)."""
    if tiers.host_pages != 0:
        return "a host tier (--host)"
    if tiers.storage_pages != 0:
        return "an L3 tier (--storage)"
    if tiers.eviction_policy != "lru":
        return f"--eviction-policy {tiers.eviction_policy}"
    if tiers.storage_admission != "always":
        return f"--admission {tiers.storage_admission}"
    if args.replay_mode != "pages":
        return "--replay-mode tokens"
    if fmt == "engine":
        return "an engine log (its cached_tokens are compared request by request)"
    return ""


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Does the work; returns the JSON document. Raises HiCacheError on bad input."""
    from tools.hitrate import fast, fast_replay
    from tools.hitrate import mrc as mrcmod
    from tools.hitrate.report import SCHEMA
    from tools.hitrate.simulate import TierConfig, replay, replay_arrays

    try:
        ev_cfg = json.loads(args.eviction_policy_config)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--eviction-policy-config is not JSON: {e.msg}") from None
    if not isinstance(ev_cfg, dict):
        raise ConfigError("--eviction-policy-config must be a JSON object")
    if args.sample is not None and not 0.0 < args.sample <= 1.0:
        raise ConfigError(f"--sample must be a rate in (0, 1], got {args.sample}")
    if args.sample_check != "all" and not (args.sample_check.isdigit()):
        raise ConfigError(f"--sample-check must be a count of requests or 'all', got "
                          f"{args.sample_check!r}")
    if not 0.0 <= args.warmup < 1.0:
        raise ConfigError(f"--warmup must be a fraction in [0, 1), got {args.warmup}")
    if args.warmup and args.replay_mode == "tokens":
        raise ConfigError("--warmup needs --replay-mode pages")
    grid_specs = {f: parse_sizes(getattr(args, f), f"--{f}") for f in ("device", "host", "storage")}
    specs = {f: v[0] for f, v in grid_specs.items()}  # the report's configuration: the first
    policies = [p.strip() for p in args.eviction_policy.split(",")]
    if not all(policies) or len(set(policies)) != len(policies):
        raise ConfigError(f"--eviction-policy: bad list {args.eviction_policy!r}")
    sweeping = len(policies) > 1 or any(len(v) > 1 for v in grid_specs.values())

    kvb = kv_bytes_option(args)  # before a long read: a wrong name or path fails at once
    if args.sample is not None:  # the sampled curve alone (tools/hitrate/sample.py)
        if sweeping:
            raise ConfigError("--sample estimates the LRU curve only; a sweep replays every "
                              "configuration exactly: drop --sample or the lists")
        if args.plot:
            raise ConfigError("--plot draws the exact report; with --sample use --json")
        from tools.hitrate.sample import sampled_report

        return sampled_report(args, kvb)
    trace, arrs, notes, streamed, t_read = read_arrays(args)
    page_size = arrs.page_size

    if kvb is None and trace.kv_bytes_per_token:
        kvb = trace.kv_bytes_per_token
        notes.append(f"kv bytes per token {kvb:g} taken from the lmcache log's shapes/dtypes")
    l3kvb = storage_kv_bytes(args, kvb)  # --codec / --codec-ratio: L3 bytes hold more tokens
    pages = {f: to_pages(specs[f], page_size, l3kvb if f == "storage" else kvb, f"--{f}")
             for f in specs}
    tiers = TierConfig(
        page_size=page_size,
        device_pages=pages["device"],
        host_pages=pages["host"] if pages["host"] is not None else None,  # type: ignore[arg-type]
        storage_pages=pages["storage"],
        write_policy=args.write_policy,
        eviction_policy=policies[0],
        eviction_config=ev_cfg,
        prefetch_policy=args.prefetch_policy,
        prefetch_threshold=args.prefetch_threshold,
        load_back_threshold=args.load_back_threshold,
        storage_admission=args.admission,
    )

    t0 = time.perf_counter()
    progress = False if args.no_progress else None
    why_not = _compiled_unfit(tiers, args, trace.format)
    engine = args.replay_engine
    if engine == "auto":
        engine = "hiradix" if why_not else "compiled"
        if why_not:
            notes.append(f"replayed by HiRadixCache (--replay-engine auto): the compiled replay "
                         f"is not exact here ({why_not})")
    if engine == "compiled" and why_not:
        raise ConfigError(f"--replay-engine compiled: not exact for this configuration ({why_not})")
    if engine == "compiled":
        sim = fast_replay.device_lru(arrs, tiers.device_pages, warmup=args.warmup)
        notes.append(
            "replayed by the compiled device-only LRU (--replay-engine " + args.replay_engine
            + ": " + ("the unbounded bound" if tiers.device_pages is None else
                      "fast_replay.tree_lru") + "), equal to HiRadixCache's replay hit for "
            "hit (tests/tools/test_fast.py); HiRadixCache's counters (cache_stats) are not "
            "kept but its evictions; --replay-engine hiradix replays through HiRadixCache itself")
    elif streamed or args.warmup:
        sim = replay_arrays(arrs, tiers, progress=progress, warmup=args.warmup)
    else:
        sim = replay(
            trace, tiers, ignore_output=args.ignore_output, progress=progress,
            mode=args.replay_mode,
        )
    t_sim = time.perf_counter() - t0

    t0 = time.perf_counter()
    share = fast.sharing(arrs)  # first: its per-page counts are freed before the stack's arrays
    stack = fast.stack_distances(arrs, warmup=args.warmup)
    n_req = stack.requests  # measured requests (after the warm-up)
    n_in = stack.input_tokens
    ub_tokens = stack.unbounded_hit_tokens
    ub_requests = stack.unbounded_hit_requests
    opt_doc = None
    total = tiers.total_pages()
    if not args.no_opt:
        if math.isinf(total):
            opt_doc = {
                "capacity_pages": None,
                "hit_tokens": ub_tokens,
                "hit_rate": _ratio(ub_tokens, n_in),
                "hit_requests": ub_requests,
                "request_hit_rate": _ratio(ub_requests, n_req),
            }
        else:
            o = fast_replay.belady(arrs, [int(total)], warmup=args.warmup)[0]
            opt_doc = {
                "capacity_pages": o.capacity_pages,
                "hit_tokens": o.hit_tokens,
                "hit_rate": _ratio(o.hit_tokens, n_in),
                "hit_requests": o.hit_requests,
                "request_hit_rate": _ratio(o.hit_requests, n_req),
            }

    def cap_bytes(p: int | None) -> float | None:
        return None if p is None or kvb is None else p * page_size * kvb

    mrc_doc = None
    if args.mrc or args.plot:
        points = []
        for c in mrcmod.mrc_points(stack, args.mrc_points):
            ht = stack.hit_tokens(c)
            points.append(
                {
                    "capacity_pages": c,
                    "capacity_tokens": c * page_size,
                    "capacity_bytes": cap_bytes(c),
                    "hit_tokens": ht,
                    "hit_rate": _ratio(ht, n_in),
                    "miss_ratio": 1 - _ratio(ht, n_in),
                    "request_hit_rate": _ratio(stack.hit_requests(c), n_req),
                }
            )
        target_doc = None
        if args.target is not None:
            tc = stack.capacity_for(args.target)
            rel_rate = args.target * _ratio(ub_tokens, n_in)
            rc = stack.capacity_for(rel_rate)
            target_doc = {
                "hit_rate": args.target,
                "capacity_pages": tc,
                "capacity_tokens": None if tc is None else tc * page_size,
                "capacity_bytes": cap_bytes(tc),
                "relative": {
                    "hit_rate": rel_rate,
                    "capacity_pages": rc,
                    "capacity_tokens": None if rc is None else rc * page_size,
                    "capacity_bytes": cap_bytes(rc),
                },
            }
        mrc_doc = {
            "model": "lru, device only",
            "points": points,
            "target": target_doc,
            "saturation_pages": stack.saturation_pages,
            "sample": None,
        }
    t_an = time.perf_counter() - t0

    prefill_s = transfer_s = ttft = None
    if args.prefill_tokens_per_s:
        sv = ttft_saved(sim.device_hit_tokens, sim.host_hit_tokens, sim.storage_hit_tokens,
                        args.prefill_tokens_per_s, kvb, args.host_bandwidth,
                        args.storage_bandwidth)
        prefill_s, transfer_s, ttft = sv.prefill_s, sv.transfer_s, sv.ttft_s
        for tier in sv.free_tiers:
            notes.append(
                f"{tier} hits counted as free transfers (no --{tier}-bandwidth or "
                "kv bytes per token)"
            )
    sweep_rows = None
    if sweeping:
        t0 = time.perf_counter()
        grid = {f: [to_pages(sp, page_size, l3kvb if f == "storage" else kvb, f"--{f}")
                    for sp in grid_specs[f]] for f in grid_specs}
        sweep_rows = run_sweep(
            arrs, tiers, grid, policies, kvb=kvb, prefill_tokens_per_s=args.prefill_tokens_per_s,
            host_bandwidth=args.host_bandwidth, storage_bandwidth=args.storage_bandwidth,
            warmup=args.warmup, progress=progress,
        )
        t_an += time.perf_counter() - t0
    if trace.format in ("chat", "completion") and not args.ignore_output:
        notes.append(
            "outputs are unknown in OpenAI request bodies: max_tokens unique tokens are "
            "inserted per request"
        )

    res = sim
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "trace": {
            "path": trace.path,
            "format": trace.format,
            "requests": n_req,
            "input_tokens": n_in,
            "output_tokens": int(arrs.output_len.sum()),
            "block_size": trace.block_size,
            "bad_lines": trace.bad_lines,
            "bad_line_numbers": trace.bad_line_numbers,
        },
        "config": {
            "page_size": page_size,
            "device_pages": tiers.device_pages,
            "host_pages": tiers.host_pages,
            "storage_pages": tiers.storage_pages,
            "device_bytes": cap_bytes(tiers.device_pages),
            "host_bytes": cap_bytes(tiers.host_pages),
            "storage_bytes": cap_bytes(tiers.storage_pages),
            "kv_bytes_per_token": kvb,
            "storage_kv_bytes_per_token": l3kvb,
            "model": args.model or args.model_path,
            "kv_dtype": args.kv_dtype,
            "tp": args.tp,
            "eviction_policy": policies[0],
            "eviction_config": ev_cfg,
            "write_policy": args.write_policy,
            "admission": args.admission,
            "prefetch_policy": args.prefetch_policy,
            "ignore_output": args.ignore_output,
            "warmup": args.warmup,
            "replay_engine": engine,
        },
        "result": {
            "requests": res.requests,
            "input_tokens": res.input_tokens,
            "hit_tokens": res.hit_tokens,
            "miss_tokens": res.input_tokens - res.hit_tokens,
            "hit_rate": _ratio(res.hit_tokens, res.input_tokens),
            "device_hit_tokens": res.device_hit_tokens,
            "host_hit_tokens": res.host_hit_tokens,
            "storage_hit_tokens": res.storage_hit_tokens,
            "device_hit_rate": _ratio(res.device_hit_tokens, res.input_tokens),
            "host_hit_rate": _ratio(res.host_hit_tokens, res.input_tokens),
            "storage_hit_rate": _ratio(res.storage_hit_tokens, res.input_tokens),
            "hit_requests": res.hit_requests,
            "request_hit_rate": _ratio(res.hit_requests, res.requests),
            "capped_tokens": res.capped_tokens,
            # L3 write volume beside the hit rate (--admission): what an SSD is asked to take.
            "l3_pages_written": int(res.cache_stats.get("storage_backup_pages", 0)),
            "l3_bytes_written": None if kvb is None else int(
                res.cache_stats.get("storage_backup_pages", 0) * page_size * kvb),
            "l3_pages_declined": int(res.cache_stats.get("storage_declined_pages", 0)),
            "cache_stats": res.cache_stats,
        },
        "unbounded": {
            "hit_tokens": ub_tokens,
            "hit_rate": _ratio(ub_tokens, n_in),
            "hit_requests": ub_requests,
            "request_hit_rate": _ratio(ub_requests, n_req),
            "pages": stack.max_pages,
        },
        "opt": opt_doc,
        "savings": {
            "prefill_tokens_saved": res.hit_tokens,
            "prefill_seconds_saved": prefill_s,
            "transfer_seconds": transfer_s,
            "ttft_saved_seconds": ttft,
            "ttft_saved_per_request_seconds": None if ttft is None else ttft / res.requests,
        },
        "reuse_distance": {
            "unit": "pages",
            "cold_pages": stack.cold_pages,
            "buckets": stack.reuse_buckets(),
        },
        "sharing": asdict(share),
        "mrc": mrc_doc,
        "sweep": sweep_rows,
        "engine": None
        if res.engine_cached_tokens is None
        else {
            "cached_tokens": res.engine_cached_tokens,
            "simulated_hit_tokens": res.hit_tokens,
            "mismatched_requests": res.engine_mismatched_requests,
            "outcomes": res.engine_outcomes,  # hit tier / miss cause -> tokens, from the log
            "predicted_outcomes": res.predicted_outcomes,  # the replay's (tokens mode)
        },
        "timing": {
            "read_s": t_read,
            "simulate_s": t_sim,
            "analysis_s": t_an,
            "requests_per_s": _ratio(res.requests, t_sim),
        },
        "notes": notes,
    }
    return doc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:  # the capacity planner (tools/hitrate/plan.py)
        from tools.hitrate import plan

        return plan.main(argv[1:])
    args = build_parser().parse_args(argv)
    doc = run_command("hicache-hitrate", args, run)
    if doc is None:
        return 2
    from tools.hitrate import report

    if args.plot:
        report.plot(doc, args.plot)
    if args.json:
        report.write_json(doc, sys.stdout)
    else:
        report.print_table(doc)
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
