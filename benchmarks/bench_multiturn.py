"""Multi-turn chat TTFT with and without HiCache (the shape of SGLang's bench_multiturn.py).

N users hold R-turn conversations that all start with one shared system prompt; each turn's
prompt is the whole history plus a new user message. `--concurrency` clients run at once; a user
whose turn finished goes to the back of the queue, so between two turns of one user every other
user runs a turn, and with a device pool smaller than the working set its history is evicted.

Runs, side by side on one random-weight mid-size Llama (prefill dominates on CPU):
  off          prefix caching off
  device       device-only radix cache
  hicache      HiCache L1+L2 (host pool large enough for the working set)
  hicache_l3   HiCache L1+L2+L3 (`file` backend)
  l3_restart   a fresh engine on the same file store: every user comes back for one more turn
  off_restart  that same extra turn with caching off (the baseline of l3_restart)

and writes TTFT p50/p90, throughput and per-tier hit tokens, with ratios against `off` and
`device`, to benchmarks/results/bench_multiturn.json.

    python benchmarks/bench_multiturn.py [--quick] [--users 16] [--turns 6] [--dtype bfloat16]
        [--device cuda] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGETS = {
    "hicache_l3_p50_vs_off": 0.2,
    "hicache_p50_vs_device": 0.5,
    "l3_restart_p50_vs_off": 0.3,
}


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The engine benchmarks' choice of model: a generated random-weight checkpoint (the
    default), a real model's shape with random weights (`--model-config`), or real weights
    (`--model`: a catalog name such as smollm2-135m-instruct, a GGUF file, a checkpoint)."""
    p.add_argument("--model-config", default=None,
                   help="a shipped config name or a config.json: that model's shape")
    p.add_argument("--load-format", default=None, choices=("auto", "dummy"),
                   help="weights: dummy (random, made on the device; the default with "
                   "--model-config) or auto (the generated checkpoint's)")
    p.add_argument("--model", default=None,
                   help="a real checkpoint with its weights: smollm2-135m-instruct (the "
                   "default model of make run), a GGUF file or a checkpoint directory")


def check_model_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """`--load-format`'s default, and the combinations `add_model_args` refuses."""
    if a.load_format is None:
        a.load_format = "dummy" if a.model_config else "auto"
    if a.model_config and a.load_format != "dummy":
        p.error("--model-config has no weights: use --load-format dummy")
    if a.model and a.model_config:
        p.error("give --model (real weights) or --model-config (a shape), not both")


def make_weights(out: Path, hidden: int, layers: int, vocab: int, seed: int = 1) -> Path:
    """A random-weight Llama (64-dim heads, 2:1 GQA) as config.json + model.safetensors."""
    from safetensors.torch import save_file

    from engine.demo_model import random_weights

    heads = max(1, hidden // 64)
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": int(hidden * 2.75) // 32 * 32,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2), "head_dim": 64,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "eos_token_id": None, "bos_token_id": None,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(random_weights(config, seed), str(out / "model.safetensors"))
    return out


def make_checkpoint(out: Path, hidden: int, layers: int, vocab: int, seed: int = 1) -> Path:
    """`make_weights` with the demo model's tokenizer."""
    from engine.demo_model import ensure_demo_model

    make_weights(out, hidden, layers, vocab, seed)
    demo = ensure_demo_model()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / f, out / f)
    return out


def make_workload(a: argparse.Namespace) -> tuple[list[int], list[list[list[int]]]]:
    rnd = random.Random(a.seed)
    system = [rnd.randrange(10, a.vocab) for _ in range(a.system_tokens)]
    users = [[[rnd.randrange(10, a.vocab) for _ in range(a.user_tokens)]
              for _ in range(a.turns)] for _ in range(a.users)]
    return system, users


def run(engine: Any, starts: list[list[int]], users: list[list[list[int]]], a: argparse.Namespace
        ) -> tuple[dict[str, Any], list[list[int]]]:
    """Play every user's turns (user u starts from history `starts[u]`); returns the summary
    and each user's final history."""
    history = [list(h) for h in starts]
    queue: deque[tuple[int, int]] = deque((u, 0) for u in range(len(users)))
    inflight: dict[str, tuple[int, int, list[int]]] = {}
    ttfts: list[float] = []
    params = {"max_new_tokens": a.output_tokens, "ignore_eos": True}
    prompt_tokens = output_tokens = 0
    t0 = time.perf_counter()
    while queue or inflight:
        while queue and len(inflight) < a.concurrency:
            u, r = queue.popleft()
            prompt = history[u] + users[u][r]
            rid = engine.add_request(input_ids=prompt, sampling_params=params)
            inflight[rid] = (u, r, prompt)
        for upd in engine.step():
            if not upd["finished"]:
                continue
            u, r, prompt = inflight.pop(upd["rid"])
            meta = upd["meta_info"]
            if meta["finish_reason"]["type"] == "abort":
                raise RuntimeError(f"request aborted: {meta['finish_reason']}")
            ttfts.append(float(meta["ttft"]))
            prompt_tokens += len(prompt)
            output_tokens += len(upd["output_ids"])
            history[u] = prompt + upd["output_ids"]
            if r + 1 < len(users[u]):
                queue.append((u, r + 1))
    wall = time.perf_counter() - t0
    engine.wait_transfers(timeout=300)
    st = engine.cache_stats()
    return summarize(st, ttfts, wall, prompt_tokens, output_tokens), history


def summarize(st: dict[str, Any], ttfts: list[float], wall: float, prompt_tokens: int,
              output_tokens: int) -> dict[str, Any]:
    ttfts.sort()
    q = statistics.quantiles(ttfts, n=10) if len(ttfts) > 1 else ttfts * 9
    return {
        "requests": len(ttfts),
        "wall_s": round(wall, 3),
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_p90_s": round(q[8], 4),
        "ttft_mean_s": round(statistics.fmean(ttfts), 4),
        "throughput_tok_s": round((prompt_tokens + output_tokens) / wall, 1),
        "output_tok_s": round(output_tokens / wall, 1),
        "prompt_tokens": prompt_tokens,
        "computed_prompt_tokens": prompt_tokens - int(st["hit_tokens"]),
        "hit_tokens": {
            "device": int(st["device_hit_tokens"]),
            "host": int(st["host_hit_tokens"]),
            "storage": int(st["storage_hit_tokens"]),
        },
        "hit_rate": round(float(st["hit_rate"]), 4),
        "evicted_tokens": int(st["evicted_tokens"]),
        "evicted_host_tokens": int(st["evicted_host_tokens"]),
        "retractions": st["scheduler"]["retractions"],
        "storage_pages_written": int(st["storage_backup_pages"]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small model and workload (~1 minute)")
    p.add_argument("--users", type=int, default=24)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--device-tokens", type=int, default=6144,
                   help="device KV pool (tokens); smaller than the working set")
    p.add_argument("--host-ratio", type=float, default=4.0)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="weights and KV dtype (auto: the engine default, float32 here)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs",
                   default="off,device,hicache,hicache_l3,l3_restart,off_restart")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON output (default benchmarks/results/bench_multiturn[_quick].json)")
    a = p.parse_args(argv)
    if a.quick:
        a.users, a.turns, a.system_tokens, a.user_tokens = 16, 4, 256, 48
        a.hidden, a.layers, a.device_tokens, a.concurrency = 512, 2, 1536, 2
    if a.out is None:
        name = "bench_multiturn_quick.json" if a.quick else "bench_multiturn.json"
        a.out = ROOT / "benchmarks" / "results" / name
    import torch

    from engine.engine import Engine

    if a.threads:
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="bench-multiturn-", ignore_cleanup_errors=True) as d:
        work = Path(d)
        model = make_checkpoint(work / "model", a.hidden, a.layers, a.vocab)
        store = work / "pages"
        system, users = make_workload(a)
        working_set = a.system_tokens + a.users * a.turns * (a.user_tokens + a.output_tokens)
        base: dict[str, Any] = {
            "model_path": str(model), "page_size": a.page_size,
            "max_total_tokens": a.device_tokens, "max_running_requests": a.concurrency,
            "chunked_prefill_size": 4096, "context_length": 8192,
            "dtype": a.dtype, "device": a.device,
        }
        hier = {"enable_hierarchical_cache": True, "hicache_ratio": a.host_ratio}
        l3 = {**hier, "hicache_storage_backend": "file",
              "hicache_storage_backend_extra_config": {"path": str(store)},
              "hicache_storage_prefetch_policy": "wait_complete"}
        configs: dict[str, dict[str, Any]] = {
            "off": {"disable_radix_cache": True},
            "device": {},
            "hicache": hier,
            "hicache_l3": l3,
            "l3_restart": l3,
            "off_restart": {"disable_radix_cache": True},
        }
        results: dict[str, Any] = {}
        starts = [list(system) for _ in users]
        final: list[list[int]] = []
        # After a restart: every user comes back for one more turn on top of its whole history.
        rnd = random.Random(a.seed + 1)
        next_turn = [[[rnd.randrange(10, a.vocab) for _ in range(a.user_tokens)]] for _ in users]
        for name in a.configs.split(","):
            if name in ("l3_restart", "off_restart") and not final:
                raise SystemExit(f"{name} needs an earlier full run (and l3_restart hicache_l3)")
            with Engine(**base, **configs[name]) as engine:
                if name in ("l3_restart", "off_restart"):
                    results[name], _ = run(engine, final, next_turn, a)
                else:
                    results[name], final = run(engine, starts, users, a)
            r = results[name]
            print(f"{name:11s} ttft p50 {r['ttft_p50_s']:.3f}s p90 {r['ttft_p90_s']:.3f}s "
                  f"thr {r['throughput_tok_s']:.0f} tok/s hits {r['hit_tokens']} "
                  f"computed {r['computed_prompt_tokens']}/{r['prompt_tokens']}", flush=True)
        ratios: dict[str, float] = {}
        for name, r in results.items():
            for ref in ("off", "device"):
                if ref in results and name != ref:
                    ratios[f"{name}_p50_vs_{ref}"] = round(
                        r["ttft_p50_s"] / results[ref]["ttft_p50_s"], 3)
                    ratios[f"{name}_p90_vs_{ref}"] = round(
                        r["ttft_p90_s"] / results[ref]["ttft_p90_s"], 3)
        if "l3_restart" in results and "off_restart" in results:
            # The restart run is one extra turn per user: compare it with the same turn uncached.
            for q in ("p50", "p90"):
                ratios[f"l3_restart_{q}_vs_off"] = round(
                    results["l3_restart"][f"ttft_{q}_s"] / results["off_restart"][f"ttft_{q}_s"], 3)
        targets = {k: {"target": v, "measured": ratios.get(k), "met": (
            ratios[k] <= v if k in ratios else None)} for k, v in TARGETS.items()}
        machine = {"platform": platform.platform(), "cpus": os.cpu_count(),
                   "torch_threads": torch.get_num_threads(),
                   "cuda": torch.cuda.get_device_name() if torch.cuda.is_available()
                   and a.device != "cpu" else None}
        write_report(a.out, "bench_multiturn", a, machine, working_set_tokens=working_set,
                     results=results, ratios=ratios, targets=targets)
    return 0


def write_report(out: Path, benchmark: str, a: argparse.Namespace, machine: dict[str, Any],
                 **sections: Any) -> None:
    """Write a benchmark's JSON report (its name, when, the machine, the parameters `a`, then
    `sections`) and print its targets (the benchmarks share this)."""
    report = {"benchmark": benchmark, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": machine,
              "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
              **sections}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    for k, t in report.get("targets", {}).items():
        target = t["target"]
        if not isinstance(target, str):
            target = f"{'>=' if t.get('min') else '<='} {target}"
        print(f"{k}: {t['measured']} (target {target}, met={t['met']})")
    print(f"wrote {out}")


if __name__ == "__main__":
    raise SystemExit(main())
