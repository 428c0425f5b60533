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

from hicache.errors import ConfigError, HiCacheError
from tools.hitrate.sizes import kv_bytes_from_model, parse_size, to_pages
from tools.hitrate.traces import MAX_LINE_BYTES, MAX_REQUEST_TOKENS, Limits

logger = logging.getLogger(__name__)

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hicache-hitrate",
        description="Cache hit-rate analysis: replays a request trace through HiCache's real "
        "HiRadixCache in simulated mode (device / host / storage tiers), with the unbounded "
        "bound, Belady's offline optimum, an LRU miss-ratio curve, reuse distances and prefix "
        "sharing. Sizes: tokens (4096, 2M), pages (64p), bytes (2GiB, 500MB) or 'unbounded'.",
    )
    p.add_argument("trace", metavar="TRACE", help="trace file (JSON lines), or a directory of them")
    g = p.add_argument_group("trace")
    g.add_argument(
        "--format",
        default="auto",
        choices=["auto", "mooncake", "lmcache", "engine", "chat", "completion"],
        help="trace format (default: detected from the first valid line)",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=512,
        metavar="N",
        help="tokens per hash_id block in mooncake traces (default 512; lmcache logs "
        "carry their own chunk_size)",
    )
    g.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="Hugging Face tokenizer directory for chat / completion traces",
    )
    g.add_argument("--limit", type=int, metavar="N", help="read only the first N requests")
    g.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip malformed lines (counted and reported) instead of stopping",
    )
    g.add_argument(
        "--max-request-tokens",
        type=int,
        default=MAX_REQUEST_TOKENS,
        metavar="N",
        help="bound on every input and output length of a request (and so on its block "
        f"count); a line over it is a bad line (default {MAX_REQUEST_TOKENS:,})",
    )
    g.add_argument(
        "--max-line-bytes",
        type=int,
        default=MAX_LINE_BYTES,
        metavar="N",
        help=f"bound on the length of one trace line (default {MAX_LINE_BYTES:,})",
    )
    g.add_argument(
        "--ignore-output",
        action="store_true",
        help="do not insert output tokens into the cache after each request",
    )
    g = p.add_argument_group("cache")
    g.add_argument(
        "--page-size",
        type=int,
        metavar="TOKENS",
        help="tokens per page (default: the block size for block traces, else 32); "
        "must divide the block size",
    )
    g.add_argument(
        "--device",
        default="unbounded",
        metavar="SIZE",
        help="device (L1) capacity (default unbounded)",
    )
    g.add_argument(
        "--host",
        default="0",
        metavar="SIZE",
        help="host memory (L2) capacity (default 0: no host tier)",
    )
    g.add_argument(
        "--storage",
        default="0",
        metavar="SIZE",
        help="storage (L3) capacity, or 'unbounded' (default 0: no storage tier)",
    )
    g.add_argument(
        "--kv-bytes-per-token",
        type=float,
        metavar="N",
        help="KV bytes per token, to read byte sizes",
    )
    g.add_argument(
        "--model-path",
        metavar="DIR",
        help="HF checkpoint directory: kv bytes per token = 2 * layers * kv_heads * "
        "head_dim * dtype bytes from its config.json",
    )
    g.add_argument(
        "--kv-dtype",
        metavar="DTYPE",
        help="KV dtype for --model-path (default: the checkpoint's torch_dtype)",
    )
    g.add_argument(
        "--eviction-policy",
        default="lru",
        metavar="NAME",
        help="lru, lfu, slru, priority, fifo, mru (default lru)",
    )
    g.add_argument(
        "--eviction-policy-config",
        default="{}",
        metavar="JSON",
        help="eviction policy config, e.g. '{\"protected_threshold\": 3}'",
    )
    g.add_argument(
        "--write-policy",
        default="write_through",
        choices=["write_through", "write_through_selective", "write_back"],
        help="device -> host write policy (default write_through)",
    )
    g.add_argument(
        "--prefetch-policy",
        default="best_effort",
        choices=["best_effort", "wait_complete", "timeout"],
        help="storage prefetch policy (default best_effort)",
    )
    g.add_argument(
        "--prefetch-threshold",
        type=int,
        metavar="TOKENS",
        help="smallest storage prefetch started (default: HiCacheConfig's, 256)",
    )
    g.add_argument(
        "--load-back-threshold",
        type=int,
        metavar="TOKENS",
        help="smallest host -> device load-back (default: HiCacheConfig's, 10)",
    )
    g = p.add_argument_group("analyses")
    g.add_argument(
        "--mrc",
        action="store_true",
        help="LRU miss-ratio curve over capacities, in one pass (stack distances)",
    )
    g.add_argument(
        "--mrc-points",
        type=int,
        default=32,
        metavar="N",
        help="points of the curve (default 32, log-spaced)",
    )
    g.add_argument(
        "--sample",
        type=float,
        metavar="RATE",
        help="with --mrc: also estimate the curve from a spatial sample of pages (SHARDS: "
        "pages whose id hash falls in RATE of the hash space, e.g. 0.01, plus every page looked "
        "up at least 1/RATE times), printed beside the exact curve with its error",
    )
    g.add_argument(
        "--target",
        type=float,
        metavar="RATE",
        help="with --mrc: the capacity needed for this token hit rate (e.g. 0.3); "
        "also reported as a fraction of the unbounded bound",
    )
    g.add_argument("--no-opt", action="store_true", help="skip Belady's optimum")
    g.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        metavar="N",
        help="prefill throughput, to estimate the TTFT saved",
    )
    g.add_argument(
        "--host-bandwidth",
        type=float,
        metavar="BYTES_PER_S",
        help="host -> device bandwidth for the TTFT estimate",
    )
    g.add_argument(
        "--storage-bandwidth",
        type=float,
        metavar="BYTES_PER_S",
        help="storage -> device bandwidth for the TTFT estimate",
    )
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print the JSON document instead of tables")
    g.add_argument("--plot", metavar="PNG", help="write MRC, tier breakdown and reuse distances")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--replay-mode",
        choices=("pages", "tokens"),
        default="pages",
        help="how requests reach HiRadixCache: 'pages' (page ids at page size 1, fast) or "
        "'tokens' (token lists at --page-size); both give identical results",
    )
    g.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Does the work; returns the JSON document. Raises HiCacheError on bad input."""
    from tools.hitrate import fast
    from tools.hitrate import mrc as mrcmod
    from tools.hitrate.arrays import BlockSink, from_trace
    from tools.hitrate.report import SCHEMA
    from tools.hitrate.simulate import TierConfig, replay, replay_arrays
    from tools.hitrate.trace_dir import read_path
    from tools.hitrate.traces import load_tokenizer

    if args.block_size < 1:
        raise ConfigError(f"--block-size must be >= 1, got {args.block_size}")
    for flag in ("max_request_tokens", "max_line_bytes"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    try:
        ev_cfg = json.loads(args.eviction_policy_config)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--eviction-policy-config is not JSON: {e.msg}") from None
    if not isinstance(ev_cfg, dict):
        raise ConfigError("--eviction-policy-config must be a JSON object")
    if args.sample is not None and not 0.0 < args.sample <= 1.0:
        raise ConfigError(f"--sample must be a rate in (0, 1], got {args.sample}")
    specs = {f: parse_size(getattr(args, f)) for f in ("device", "host", "storage")}

    kvb = args.kv_bytes_per_token
    if kvb is None and args.model_path:  # before a long read: a wrong path fails at once
        kvb = kv_bytes_from_model(args.model_path, args.kv_dtype)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    # Block traces stream into arrays (no Request kept per line) unless tokens are replayed.
    sink = BlockSink() if args.replay_mode == "pages" else None
    trace, notes = read_path(
        args.trace,
        args.format,
        block_size=args.block_size,
        tokenizer=tokenizer,
        skip_bad_lines=args.skip_bad_lines,
        limit=args.limit,
        limits=Limits(args.max_request_tokens, args.max_line_bytes),
        sink=sink,
    )
    if not trace.count:
        raise HiCacheError(f"{args.trace}: no requests")
    page_size = args.page_size or trace.block_size or 32
    streamed = sink is not None and len(sink) > 0
    if streamed:
        assert sink is not None
        arrs = sink.arrays(trace, page_size, ignore_output=args.ignore_output)
        del sink
    else:
        arrs = from_trace(trace, page_size, ignore_output=args.ignore_output)
    t_read = time.perf_counter() - t0

    if kvb is None and trace.kv_bytes_per_token:
        kvb = trace.kv_bytes_per_token
        notes.append(f"kv bytes per token {kvb:g} taken from the lmcache log's shapes/dtypes")
    pages = {f: to_pages(specs[f], page_size, kvb, f"--{f}") for f in specs}
    tiers = TierConfig(
        page_size=page_size,
        device_pages=pages["device"],
        host_pages=pages["host"] if pages["host"] is not None else None,  # type: ignore[arg-type]
        storage_pages=pages["storage"],
        write_policy=args.write_policy,
        eviction_policy=args.eviction_policy,
        eviction_config=ev_cfg,
        prefetch_policy=args.prefetch_policy,
        prefetch_threshold=args.prefetch_threshold,
        load_back_threshold=args.load_back_threshold,
    )

    t0 = time.perf_counter()
    progress = False if args.no_progress else None
    if streamed:
        sim = replay_arrays(arrs, tiers, progress=progress)
    else:
        sim = replay(
            trace, tiers, ignore_output=args.ignore_output, progress=progress,
            mode=args.replay_mode,
        )
    t_sim = time.perf_counter() - t0

    t0 = time.perf_counter()
    n_req = arrs.requests
    stack = fast.stack_distances(arrs)
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
            o = fast.belady(arrs, [int(total)])[0]
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
            c = stack.capacity_for(args.target)
            rel_rate = args.target * _ratio(ub_tokens, n_in)
            rc = stack.capacity_for(rel_rate)
            target_doc = {
                "hit_rate": args.target,
                "capacity_pages": c,
                "capacity_tokens": None if c is None else c * page_size,
                "capacity_bytes": cap_bytes(c),
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
        if args.sample is not None:
            ts = time.perf_counter()
            samp = fast.sampled_stack(arrs, args.sample)
            t_samp = time.perf_counter() - ts
            errs = []
            for pt in points:
                est = _ratio(samp.hit_tokens(pt["capacity_pages"]), n_in)
                pt["sampled_hit_rate"] = est
                errs.append(abs(est - pt["hit_rate"]))
            mrc_doc["sample"] = {
                "rate": args.sample,
                "sampled_page_refs": samp.sampled_refs,
                "page_refs": len(arrs.pages),
                "seconds": t_samp,
                "max_abs_error": max(errs, default=0.0),
                "mean_abs_error": sum(errs) / len(errs) if errs else 0.0,
            }
    share = fast.sharing(arrs)
    t_an = time.perf_counter() - t0

    prefill_s = transfer_s = ttft = None
    if args.prefill_tokens_per_s:
        prefill_s = sim.hit_tokens / args.prefill_tokens_per_s
        transfer_s = 0.0
        for tier, bw in (("host", args.host_bandwidth), ("storage", args.storage_bandwidth)):
            moved = getattr(sim, f"{tier}_hit_tokens")
            if not moved:
                continue
            if bw and kvb:
                transfer_s += moved * kvb / bw
            else:
                notes.append(
                    f"{tier} hits counted as free transfers (no --{tier}-bandwidth or "
                    "kv bytes per token)"
                )
        ttft = prefill_s - transfer_s
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
            "eviction_policy": args.eviction_policy,
            "eviction_config": ev_cfg,
            "write_policy": args.write_policy,
            "prefetch_policy": args.prefetch_policy,
            "ignore_output": args.ignore_output,
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
        "engine": None
        if res.engine_cached_tokens is None
        else {
            "cached_tokens": res.engine_cached_tokens,
            "simulated_hit_tokens": res.hit_tokens,
            "mismatched_requests": res.engine_mismatched_requests,
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
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        doc = run(args)
    except HiCacheError as e:
        print(f"hicache-hitrate: error: {e}", file=sys.stderr)
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
