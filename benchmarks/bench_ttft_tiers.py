"""TTFT of one long prompt served from each cache tier, against computing it, in one run.

One random-weight Llama-shaped checkpoint, one engine with the host tier and the `file` L3
backend (`wait_complete` prefetch), one prompt of `--tokens` tokens:

  compute   the prompt computed from scratch (caching on, cold)
  device    the prompt again + 64 new tokens: the prefix is on the device (L1 hit)
  host      the prompt + 64 other new tokens after every device copy was evicted (L2 hit)
  l3        the prompt + 64 other new tokens in a *restarted* engine on the same store (L3 hit)

Each row runs `--repeats` times (a new prompt for `compute`, a new tail otherwise) and keeps the
best TTFT: on a shared machine noise only adds time. Each tier row is also given as a ratio to `compute` (the issue's targets on CPU: device <= 0.03,
host <= 0.04, l3 <= 0.06, L3 read >= 0.5 GB/s). The L3 row also reports the prefetch's read
throughput (bytes / seconds spent in storage reads) next to a raw read of the same record files
(`open().readinto` of every file in the store), i.e. the backend's own speed limit.

    python benchmarks/bench_ttft_tiers.py [--quick] [--hidden 1024 --layers 4 --tokens 4000]
        [--dtype float32] [--device cpu] [--profile DIR] [--out PATH]
        [--model-config llama-3.1-8b|PATH/config.json [--load-format dummy]]

`--model-config` runs a real model's shape instead of the generated Llama (`--hidden`, `--layers`,
`--vocab` are then ignored): a shipped config (`llama-3.1-8b`, `qwen2.5-7b`, `deepseek-v2-lite`)
or a config.json, with random weights made on the device (`--load-format dummy`, the default
with a config; no checkpoint, no tokenizer, no network).

`--profile DIR` writes a cProfile dump of each tier's request (`DIR/<row>.prof`).

Every row also carries `forward_s` (the model's forward inside that request, for its
`computed_tokens`: the new tokens plus the prompt's last partial page, which no cache holds) and
`outside_forward_s` (the rest: matching, loads, waiting for a prefetch, scheduling); `ratios` gives
both as `<row>_forward_vs_compute` and `<row>_outside_forward_vs_compute`, i.e. what the forward
of the uncached tokens costs and what the cache itself costs.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_multiturn import add_model_args, check_model_args, write_report  # noqa: E402

TARGETS_CPU = {"device_vs_compute": 0.03, "host_vs_compute": 0.04, "l3_vs_compute": 0.06}
TARGETS_GPU = {"device_vs_compute": 0.1, "host_vs_compute": 0.25, "l3_vs_compute": 0.5}
# Issue 30's targets at a deployed model's shape (--model-config, e.g. Llama-3.1-8B, 8k prompt).
TARGETS_GPU_MODEL = {"device_vs_compute": 0.05, "host_vs_compute": 0.15, "l3_vs_compute": 0.35}
L3_READ_TARGET_GBS = 0.5
NEW_TOKENS = 64


def one_request(engine: Any, ids: list[int], profile: Path | None = None) -> dict[str, Any]:
    """Serve `ids` with one output token; return its TTFT and where its prefix came from."""
    before = engine.cache_stats()
    runner, fwd = engine.runner, engine.runner.forward
    spent = [0.0]

    def timed_forward(*args: Any, **kw: Any) -> Any:  # the model's own share of the TTFT
        t0 = time.perf_counter()
        try:
            return fwd(*args, **kw)
        finally:
            spent[0] += time.perf_counter() - t0

    runner.forward = timed_forward
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    rid = engine.add_request(input_ids=ids, sampling_params={"max_new_tokens": 1})
    meta: dict[str, Any] | None = None
    while meta is None:
        for upd in engine.step():
            if upd["rid"] == rid and upd["finished"]:
                meta = upd["meta_info"]
    del runner.forward  # back to the class's method
    if prof:
        prof.disable()
        assert profile is not None
        prof.dump_stats(str(profile))
    after = engine.cache_stats()
    hits = {t: int(after[f"{t}_hit_tokens"] - before[f"{t}_hit_tokens"])
            for t in ("device", "host", "storage")}
    ttft = float(meta["ttft"])
    return {"ttft_s": round(ttft, 5), "prompt_tokens": len(ids),
            "cached_tokens": int(meta["cached_tokens"]), "hit_tokens": hits,
            "computed_tokens": len(ids) - int(meta["cached_tokens"]),
            "forward_s": round(spent[0], 5), "outside_forward_s": round(ttft - spent[0], 5)}


def raw_read_gbs(store: Path, repeats: int = 3) -> tuple[float, int]:
    """GB/s of reading every record file under `store` into one preallocated buffer."""
    files = sorted(p for p in store.rglob("*") if p.is_file() and not p.name.startswith("."))
    total = sum(p.stat().st_size for p in files)
    buf = bytearray(max((p.stat().st_size for p in files), default=1))
    mv = memoryview(buf)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for p in files:
            with open(p, "rb", buffering=0) as f:
                f.readinto(mv)
        best = min(best, time.perf_counter() - t0)
    return (total / best / 1e9 if best > 0 else 0.0), total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model and prompt (seconds)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    add_model_args(p)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    p.add_argument("--io-backend", default="direct")
    p.add_argument("--mem-layout", default="layer_first")
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per tier row (each with its own tail); rows keep the best")
    p.add_argument("--compute-repeats", type=int, default=None,
                   help="runs of the compute row, each a new prompt (default: --repeats)")
    p.add_argument("--profile", type=Path, default=None, help="cProfile dumps into this folder")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON output (default benchmarks/results/bench_ttft_tiers[_quick].json)")
    a = p.parse_args(argv)
    if a.quick:
        a.hidden, a.layers, a.tokens, a.vocab = 256, 2, 1024, 1024
    check_model_args(p, a)
    if a.out is None:
        out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benchmarks/results"
        a.out = out_dir / ("bench_ttft_tiers_quick.json" if a.quick else "bench_ttft_tiers.json")
    import torch
    from bench_multiturn import make_checkpoint

    from engine.engine import Engine
    from engine.models.config import ModelConfig, kv_bytes_per_token
    from engine.models.dummy import config_dir_of

    if a.threads:
        torch.set_num_threads(a.threads)
    if a.profile:
        a.profile.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(a.seed)
    model_dir = config_dir_of(a.model_config) if a.model_config else None
    if a.model:
        from engine.demo_model import resolve_model_path

        model_dir = resolve_model_path(a.model)
    if model_dir is not None:
        a.vocab = ModelConfig.from_dir(model_dir).vocab_size
    a.compute_repeats = a.compute_repeats or a.repeats
    prompts = [[rnd.randrange(10, a.vocab) for _ in range(a.tokens)]
               for _ in range(a.compute_repeats)]
    tails = [[rnd.randrange(10, a.vocab) for _ in range(NEW_TOKENS)]
             for _ in range(3 * a.repeats)]
    warm = [rnd.randrange(10, a.vocab) for _ in range(min(64, a.tokens))]

    def prof(name: str) -> Path | None:
        return a.profile / f"{name}.prof" if a.profile else None

    with tempfile.TemporaryDirectory(prefix="bench-ttft-tiers-", ignore_cleanup_errors=True) as d:
        work = Path(d)
        model = model_dir or make_checkpoint(work / "model", a.hidden, a.layers, a.vocab)
        cfg = ModelConfig.from_dir(model)
        store = work / "pages"
        kw: dict[str, Any] = {
            "model_path": str(model), "load_format": a.load_format, "page_size": a.page_size,
            "dtype": a.dtype,
            "device": a.device, "max_total_tokens": 2 * a.tokens + (3 * a.repeats + 2) * NEW_TOKENS,
            "max_running_requests": 4, "chunked_prefill_size": a.chunked_prefill_size,
            "context_length": a.tokens + 2 * NEW_TOKENS, "enable_hierarchical_cache": True,
            "hicache_ratio": 2.0, "hicache_io_backend": a.io_backend,
            "hicache_mem_layout": a.mem_layout, "hicache_storage_backend": "file",
            "hicache_storage_backend_extra_config": {"path": str(store)},
            "hicache_storage_prefetch_policy": "wait_complete",
        }
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in ("compute", "device", "host", "l3")}
        with Engine(**kw) as eng:
            one_request(eng, warm)  # first-forward set-up costs stay out of the rows
            for i, pr in enumerate(prompts):
                runs["compute"].append(one_request(eng, pr, prof("compute") if i == 0 else None))
                eng.wait_transfers(timeout=600)
                if i + 1 < len(prompts):
                    eng.flush_cache()  # device and host; L3 keeps the pages
            prompt = prompts[-1]
            for i in range(a.repeats):
                runs["device"].append(
                    one_request(eng, prompt + tails[i], prof("device") if i == 0 else None))
            for i in range(a.repeats):
                eng.wait_transfers(timeout=600)
                evicted = eng.cache.evict(eng.max_total_tokens)
                r = one_request(eng, prompt + tails[a.repeats + i], prof("host") if i == 0 else None)
                r["evicted_tokens_before"] = evicted
                runs["host"].append(r)
            eng.wait_transfers(timeout=600)
        nbytes = secs = 0.0
        cost_model = None
        for i in range(a.repeats):
            with Engine(**kw) as eng:
                one_request(eng, warm)
                runs["l3"].append(one_request(
                    eng, prompt + tails[2 * a.repeats + i], prof("l3") if i == 0 else None))
                st = eng.cache_stats()
                cost_model = st["cost_model"]
                nbytes += float(st["prefetch_bytes"])
                secs += float(st["prefetch_seconds"])
        # Each row: the best of the repeats (a shared machine's noise only ever adds time).
        rows: dict[str, Any] = {}
        for k, rs in runs.items():
            best = min(rs, key=lambda r: r["ttft_s"])
            rows[k] = {**best, "ttft_all_s": [r["ttft_s"] for r in rs]}
        rows["l3"]["read_bytes"] = int(nbytes)
        rows["l3"]["read_s"] = round(secs, 5)
        rows["l3"]["read_gbs"] = round(nbytes / secs / 1e9, 4) if secs else None
        raw_gbs, raw_bytes = raw_read_gbs(store)
        rows["l3"]["raw_read_gbs"] = round(raw_gbs, 4)
        rows["l3"]["raw_read_bytes"] = raw_bytes
        if rows["l3"]["read_gbs"]:
            rows["l3"]["read_vs_raw"] = round(rows["l3"]["read_gbs"] / raw_gbs, 3)
        base = rows["compute"]["ttft_s"]
        ratios = {f"{k}_vs_compute": round(rows[k]["ttft_s"] / base, 4)
                  for k in ("device", "host", "l3")}
        # What the cache cannot remove: the forward of the tokens it does not hold (the 64 new
        # ones plus the prompt's last partial page), as a share of `compute`. The rest of a
        # row's ratio is the cache's own cost (matching, loads, scheduling).
        for k in ("device", "host", "l3"):
            ratios[f"{k}_forward_vs_compute"] = round(rows[k]["forward_s"] / base, 4)
            ratios[f"{k}_outside_forward_vs_compute"] = round(
                rows[k]["outside_forward_s"] / base, 4)
        targets_of = (TARGETS_CPU if not a.device.startswith("cuda") else
                      TARGETS_GPU_MODEL if a.model_config else TARGETS_GPU)
        targets: dict[str, Any] = {
            k: {"target": v, "measured": ratios[k], "met": ratios[k] <= v}
            for k, v in targets_of.items()
        }
        read = rows["l3"]["read_gbs"]
        targets["l3_read_gbs"] = {"target": L3_READ_TARGET_GBS, "measured": read,
                                  "met": bool(read and read >= L3_READ_TARGET_GBS), "min": True}
        for name, r in rows.items():
            print(f"{name:8s} ttft {r['ttft_s']:.4f}s  forward {r['forward_s']:.4f}s "
                  f"({r['computed_tokens']} tokens)  hits {r['hit_tokens']}", flush=True)
        machine = {"platform": platform.platform(), "cpus": os.cpu_count(),
                   "torch_threads": torch.get_num_threads(),
                   "cuda": torch.cuda.get_device_name() if a.device.startswith("cuda") else None}
        model_info = {"config": str(model_dir or "generated"), "model_type": cfg.model_type,
                      "hidden": cfg.hidden_size, "layers": cfg.num_layers,
                      "vocab": cfg.vocab_size, "load_format": a.load_format}
        kv_bytes = kv_bytes_per_token(
            cfg, torch.tensor([], dtype=getattr(torch, a.dtype)).element_size())
        # cost_model: the start-up calibration of the last engine (hicache.calibration).
        write_report(a.out, "bench_ttft_tiers", a, machine, model=model_info,
                     kv_bytes_per_token=kv_bytes, cost_model=cost_model, rows=rows,
                     ratios=ratios, targets=targets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
