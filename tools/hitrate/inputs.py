"""What `hicache-hitrate` and `hicache-hitrate plan` read the same way: the KV bytes per token
(--kv-bytes-per-token, --model, --model-path) and the trace, into page arrays."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from hicache_client.errors import ConfigError, HiCacheError
from tools.hitrate import catalog
from tools.hitrate.sizes import kv_bytes_from_model
from tools.hitrate.traces import Limits


def storage_kv_bytes(args: argparse.Namespace, kvb: float | None) -> float | None:
    """KV bytes per token in L3: `kvb` over the ratio of --codec or --codec-ratio."""
    name, ratio = getattr(args, "codec", None), getattr(args, "codec_ratio", None)
    if name and ratio:
        raise ConfigError("--codec and --codec-ratio both give the L3 compression: pass one")
    if name:
        from hicache_client.compression import MEASURED_RATIO

        if name not in MEASURED_RATIO:
            raise ConfigError(f"unknown --codec {name!r}; known: {', '.join(MEASURED_RATIO)}")
        ratio = MEASURED_RATIO[name]
    if ratio is not None and ratio <= 0:
        raise ConfigError(f"--codec-ratio must be > 0, got {ratio}")
    return kvb / ratio if kvb and ratio else kvb


def kv_bytes_option(args: argparse.Namespace) -> float | None:
    """KV bytes per token from --kv-bytes-per-token, --model or --model-path (at most one)."""
    given = [f for f in ("kv_bytes_per_token", "model", "model_path") if getattr(args, f, None)]
    if len(given) > 1:
        flags = " and ".join("--" + f.replace("_", "-") for f in given)
        raise ConfigError(f"{flags} both give the KV bytes per token: pass one")
    if args.tp < 1:
        raise ConfigError(f"--tp must be >= 1, got {args.tp}")
    if args.model:
        return catalog.kv_bytes_per_token(args.model, args.kv_dtype, args.tp)
    if args.model_path:
        return kv_bytes_from_model(args.model_path, args.kv_dtype, args.tp)
    return args.kv_bytes_per_token


def read_arrays(args: argparse.Namespace) -> tuple[Any, Any, list[str], bool, float]:
    """Reads TRACE (the trace flags of `options.add_trace_args`) into page arrays: (trace,
    arrays, notes, whether the trace streamed into arrays without Requests, seconds)."""
    from tools.hitrate.arrays import BlockSink, from_trace
    from tools.hitrate.trace_dir import read_path
    from tools.hitrate.traces import load_tokenizer

    if args.block_size < 1:
        raise ConfigError(f"--block-size must be >= 1, got {args.block_size}")
    for flag in ("max_request_tokens", "max_line_bytes"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    # Block traces stream into arrays (no Request kept per line) unless tokens are replayed.
    sink = BlockSink() if getattr(args, "replay_mode", "pages") == "pages" else None
    trace, notes = read_path(
        args.trace,
        args.format,
        block_size=args.block_size,
        tokenizer=tokenizer,
        skip_bad_lines=args.skip_bad_lines,
        limit=args.limit,
        limits=Limits(args.max_request_tokens, args.max_line_bytes),
        sink=sink,
        progress=False if args.no_progress else None,
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
    return trace, arrs, notes, streamed, t_read


def run_command(
    prog: str, args: argparse.Namespace, run: Callable[[argparse.Namespace], dict[str, Any]]
) -> dict[str, Any] | None:
    """An entry point's body: logging by `--verbose`, then `run(args)`; a `HiCacheError` is one
    line on stderr (`PROG: error: ...`) and None (the caller exits 2)."""
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except HiCacheError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return None
