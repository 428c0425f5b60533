"""The command line of `hicache-hitrate`: every flag, its default and its help text
(docs/hitrate.md's table describes the same flags; a test checks both list every one)."""

from __future__ import annotations

import argparse
from typing import Any

from tools.hitrate.traces import MAX_LINE_BYTES, MAX_REQUEST_TOKENS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hicache-hitrate",
        description="Cache hit-rate analysis: replays a request trace through HiCache's real "
        "HiRadixCache in simulated mode (device / host / storage tiers), with the unbounded "
        "bound, Belady's offline optimum, an LRU miss-ratio curve, reuse distances and prefix "
        "sharing. Sizes: tokens (4096, 2M), pages (64p), bytes (2GiB, 500MB) or 'unbounded'; "
        "--device/--host/--storage also take lists and ranges (8GiB,16GiB or 4GiB:64GiB:x2 or "
        "1024p:8192p:+1024p), and several --eviction-policy values (lru,fifo): every "
        "combination is replayed (a sweep; the first values make the main report). Capacity "
        "planning from prices: 'hicache-hitrate plan --help'.",
    )
    add_trace_args(p)
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
        help="device (L1) capacity, or a list / range of them to sweep (default unbounded)",
    )
    g.add_argument(
        "--host",
        default="0",
        metavar="SIZE",
        help="host memory (L2) capacity, or a list / range to sweep (default 0: no host tier)",
    )
    g.add_argument(
        "--storage",
        default="0",
        metavar="SIZE",
        help="storage (L3) capacity, or 'unbounded', or a list / range to sweep (default 0: no "
        "storage tier)",
    )
    add_model_args(g)
    g.add_argument(
        "--eviction-policy",
        default="lru",
        metavar="NAME",
        help="lru, lfu, slru, priority, fifo, mru, or a comma list of them replayed side by side "
        "(default lru)",
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
        "--admission",
        default="always",
        metavar="SPEC",
        help="L3 admission, as the engine's --hicache-storage-admission: always, reuse:N, "
        "frequency[:HALF_LIFE] (default always); the report gives L3 pages and bytes written",
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
        help="the LRU miss-ratio curve alone, from a spatial sample of pages taken while the "
        "trace is read (SHARDS: pages whose hash falls in RATE of the hash space, e.g. 0.01, each "
        "standing for 1/RATE pages; blocks looked up >= 1/RATE times in the validation slice "
        "kept whole): memory and time of the curve drop about 1/RATE; no replay, Belady, "
        "unbounded bound, request hit rates, reuse distances or sharing (they need every page). "
        "Printed with the error measured on the validation slice (--sample-check)",
    )
    g.add_argument(
        "--sample-check",
        default="1000000",
        metavar="REQUESTS",
        help="with --sample: the validation slice, the first REQUESTS requests, kept whole: its "
        "exact curve against its sampled curve gives the printed error (max and mean absolute "
        "hit rate at the printed capacities); 'all' keeps the whole trace (an exact pass too); "
        "0 none (default 1000000)",
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
        "--warmup",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="the first FRACTION of requests (e.g. 0.1) fills the cache and is not counted: "
        "every hit rate (replay, sweep, unbounded, OPT, MRC) is measured in steady state "
        "(default 0)",
    )
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
    g.add_argument(
        "--replay-engine",
        choices=("auto", "hiradix", "compiled"),
        default="auto",
        help="what replays the configuration: 'hiradix' the real HiRadixCache (simulated), "
        "'compiled' the compiled device-only LRU (tools/hitrate/fast_replay.py; the unbounded "
        "bound when --device is unbounded), equal to HiRadixCache's replay hit for hit (tested) "
        "but only for a device-only LRU configuration and without HiRadixCache's counters; "
        "'auto' (default) compiled wherever it is exact (any trace size), else hiradix, "
        "with the reason in the notes; the JSON's config.replay_engine says which ran",
    )
    g.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """TRACE and the flags that read it (shared with `hicache-hitrate plan`)."""
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


def add_model_args(g: Any) -> None:
    """The flags giving KV bytes per token (shared with `hicache-hitrate plan`)."""
    g.add_argument(
        "--codec",
        metavar="NAME",
        help="the L3 KV compression (none, lossless, fp8, int4; --hicache-storage-codec): "
        "--storage bytes hold its measured ratio more tokens (hicache_client/compression.py "
        "MEASURED_RATIO, bf16 KV of SmolLM2-135M); lossy ones change the model's outputs "
        "(docs/storage.md)",
    )
    g.add_argument(
        "--codec-ratio",
        type=float,
        metavar="X",
        help="the L3 compression ratio instead of --codec's measured one: --storage bytes "
        "hold X times the tokens",
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
        "head_dim * dtype bytes from its config.json (MLA: layers * (kv_lora_rank + "
        "qk_rope_head_dim) * dtype bytes)",
    )
    g.add_argument(
        "--model",
        metavar="NAME",
        help="a model from the catalog (tools/hitrate/catalog.py: llama-3.1-8b, qwen3-32b, "
        "deepseek-v3, kimi-k2, gemma-3-27b, gpt-oss-120b, glm-4.5, ...): its KV bytes per "
        "token at --kv-dtype and --tp; an unknown name lists the known ones",
    )
    g.add_argument(
        "--kv-dtype",
        metavar="DTYPE",
        help="KV dtype: bf16, fp8 or fp4 with --model (default bf16); with --model-path also "
        "torch names such as float16 (default: the checkpoint's torch_dtype)",
    )
    g.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel size for --model / --model-path: sizes are per rank, each rank "
        "keeping kv_heads / N KV heads (one, replicated, when kv_heads < N; MLA's latent is "
        "replicated on every rank) (default 1)",
    )
