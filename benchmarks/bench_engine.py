"""Engine forward speed next to `transformers` on the same random-weight checkpoint, in one run.

  prefill_long   one long prompt: our `ModelRunner.forward` vs the transformers forward
  prefill_batch  several prompts in one ragged forward vs one padded-free transformers forward
                 of the same prompts stacked as a batch (all the same length)
  decode_bsN     ms per decode step of N requests (greedy, argmax fed back as the engine does)
                 vs transformers `generate` run one request at a time (ms per token); the ratio
                 is tokens/s ours over tokens/s theirs
  engine_tpN     with --tp-size N: the whole `Engine` (scheduler, HiCache with a host tier,
                 sampling) on the same checkpoint at tp_size 1 and N in one run: a cold round
                 of prompts sharing a system prompt, then a warm round continuing them (device
                 hits); tokens/s of each, the ratio TP=N / TP=1, whether the greedy outputs are
                 equal, and the cache-agreement collectives per forward step

Writes benchmarks/results/bench_engine[_quick].json. Compare ratios, not absolute times.

    python benchmarks/bench_engine.py [--quick] [--device cpu|cuda] [--dtype float32]
        [--hidden 256] [--layers 4] [--attention-backend auto] [--tp-size 2]
        [--model-config llama-3.1-8b|PATH/config.json [--load-format dummy]]
        [--prompt-tokens 8192,32768]

--model-config: a real model's shape (a shipped config or a config.json) with random weights made
on the device (--load-format dummy, the default with a config), next to a transformers model
built from the same config on the device (its own random weights: speed, not outputs, is
compared). --prompt-tokens takes several lengths: prefill_long is the first, prefill_long_<N> the
others.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_multiturn import (  # noqa: E402
    add_model_args,
    check_model_args,
    make_checkpoint,
    make_weights,
)


def timed(
    fn: Callable[[], Any], sync: Callable[[], None], repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Best of `repeats` times (seconds, by `clock`) after one warm-up call."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        sync()
        best = min(best, clock() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a size that runs in about a minute on CPU")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--cuda-graph-max-bs", type=int, default=64,
                   help="decode CUDA graphs up to this batch (CUDA + triton; 0: off)")
    add_model_args(p)
    p.add_argument("--prompt-tokens", default="2048",
                   help="the long prompt's tokens (a comma list: one prefill_long row each)")
    p.add_argument("--batch-prompts", type=int, default=8, help="prompts in the batched prefill")
    p.add_argument("--batch-prompt-tokens", type=int, default=256)
    p.add_argument("--decode-batches", default="1,16,64")
    p.add_argument("--decode-context", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: default)")
    p.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                   help="cpu: this process's CPU time (CPU device, robust on a shared machine; "
                   "meaningful with --threads 1)")
    p.add_argument("--tp-size", type=int, default=1,
                   help="also measure the whole engine at this tensor-parallel size next to "
                   "tp_size 1 (engine_tpN rows; on CUDA one device per rank)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.hidden, a.layers, a.vocab = 256, 2, 4096
        a.prompt_tokens, a.batch_prompts, a.batch_prompt_tokens = "512", 4, 128
        a.decode_context, a.decode_steps, a.repeats = 64, 8, 2
    check_model_args(p, a)
    long_prompts = [int(x) for x in str(a.prompt_tokens).split(",") if x]

    import torch
    from transformers import AutoModelForCausalLM

    from engine.model_runner import ModelRunner
    from engine.models import load_model

    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype)
    cuda = device.type == "cuda"
    if cuda and a.clock == "cpu":
        p.error("--clock cpu measures CPU time; use wall on CUDA")
    clock = time.process_time if a.clock == "cpu" else time.perf_counter

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    decode_batches = [int(x) for x in a.decode_batches.split(",") if x]
    g = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(10, a.vocab, (n,), generator=g).tolist()

    if a.model:
        from engine.demo_model import resolve_model_path

        path = resolve_model_path(a.model)  # a GGUF becomes its converted HF checkpoint
        model = load_model(path, dtype=dtype, device=device)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        a.vocab = model.config.vocab_size
    elif a.model_config:
        model, hf = real_shape_models(a.model_config, dtype, device)
        a.vocab = model.config.vocab_size
    else:
        with tempfile.TemporaryDirectory() as tmp:
            path = make_weights(Path(tmp) / "ckpt", a.hidden, a.layers, a.vocab)
            model = load_model(path, dtype=dtype, device=device, load_format=a.load_format)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    ps = a.page_size
    need = max(*long_prompts, a.batch_prompts * a.batch_prompt_tokens,
               max(decode_batches) * (a.decode_context + a.decode_steps + 2 * ps))
    kw: dict[str, Any] = {}
    if "cuda_graph_max_bs" in inspect.signature(ModelRunner).parameters:  # not before graphs
        kw = {"cuda_graph_max_bs": a.cuda_graph_max_bs, "context_length": need}
    runner = ModelRunner(model, num_pages=need // ps + 8, page_size=ps, dtype=dtype, device=device,
                         attention_backend=a.attention_backend, **kw)
    alloc = runner.pool.allocator
    results: dict[str, Any] = {}

    def pages_for(n_tokens: int) -> list[int]:
        got = alloc.alloc(-(-n_tokens // ps))
        assert got is not None, "pool too small"
        return got

    # ---- prefill ------------------------------------------------------------------------
    def prefill_case(name: str, prompts: list[list[int]]) -> None:
        tables = [pages_for(len(x)) for x in prompts]
        seqs = [(x, 0, t) for x, t in zip(prompts, tables)]
        ours = timed(lambda: runner.forward(seqs), sync, a.repeats, clock)
        ids = torch.tensor(prompts, device=device)
        with torch.no_grad():
            theirs = timed(lambda: hf(ids, use_cache=False, logits_to_keep=1), sync, a.repeats, clock)
        for t in tables:
            alloc.free(t)
        tokens = sum(len(x) for x in prompts)
        results[name] = {
            "tokens": tokens, "ours_tok_s": tokens / ours, "transformers_tok_s": tokens / theirs,
            "ratio": theirs / ours,
        }
        print(f"{name:14s} {tokens:6d} tok  ours {tokens / ours:10.0f} tok/s  "
              f"transformers {tokens / theirs:10.0f} tok/s  ratio {theirs / ours:.2f}x", flush=True)

    for i, n in enumerate(long_prompts):
        prefill_case("prefill_long" if i == 0 else f"prefill_long_{n}", [prompt(n)])
    prefill_case("prefill_batch", [prompt(a.batch_prompt_tokens) for _ in range(a.batch_prompts)])

    # ---- decode -------------------------------------------------------------------------
    ctx, steps = a.decode_context, a.decode_steps
    x = torch.tensor([prompt(ctx)], device=device)
    with torch.no_grad():
        def gen(n: int) -> Callable[[], Any]:
            return lambda: hf.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                       pad_token_id=0)
        t1 = timed(gen(1), sync, a.repeats, clock)
        tn = timed(gen(steps + 1), sync, a.repeats, clock)
    hf_ms = (tn - t1) / steps * 1e3
    for bs in decode_batches:
        prompts = [prompt(ctx) for _ in range(bs)]
        tables = [pages_for(ctx + steps + 1) for _ in range(bs)]
        logits = runner.forward([(q, 0, t) for q, t in zip(prompts, tables)])
        first = logits.argmax(-1).tolist()

        def decode_run(first: list[int] = first, tables: list[list[int]] = tables) -> None:
            toks = list(first)
            for s in range(steps):
                out = runner.forward([([tok], ctx + s, t) for tok, t in zip(toks, tables)])
                toks = out.argmax(-1).tolist()

        ours_ms = timed(decode_run, sync, a.repeats, clock) / steps * 1e3
        for t in tables:
            alloc.free(t)
        ratio = (bs / ours_ms) / (1 / hf_ms)
        results[f"decode_bs{bs}"] = {
            "batch": bs, "context": ctx, "ours_ms_per_step": ours_ms,
            "transformers_ms_per_token": hf_ms, "ours_tok_s": bs / ours_ms * 1e3,
            "transformers_tok_s": 1e3 / hf_ms, "ratio": ratio,
        }
        print(f"decode bs={bs:3d}  ours {ours_ms:8.2f} ms/step  transformers {hf_ms:8.2f} "
              f"ms/token (one request at a time)  tokens/s ratio {ratio:.2f}x", flush=True)

    if a.tp_size > 1:
        results.update(engine_tp_rows(a, device, dtype))

    report = {
        "benchmark": "bench_engine",
        "args": vars(a),
        "model": {"config": a.model_config or "generated", "model_type": model.config.model_type,
                  "hidden": model.config.hidden_size, "layers": model.config.num_layers,
                  "vocab": model.config.vocab_size, "load_format": a.load_format},
        "attention_backend": runner.attn.name,
        "cuda_graph": bool(getattr(runner, "graph_runner", None)),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "results": results,
    }
    out = Path(a.out) if a.out else (
        ROOT / "benchmarks" / "results" / f"bench_engine{'_quick' if a.quick else ''}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def real_shape_models(spec: str, dtype: Any, device: Any) -> tuple[Any, Any]:
    """Ours (dummy weights) and a transformers model from the same config, both made on the
    device (the transformers one with its own random initialisation)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.models import load_model
    from engine.models.dummy import config_dir_of

    cfg_dir = config_dir_of(spec)
    ours = load_model(cfg_dir, dtype=dtype, device=device, load_format="dummy")
    hf_cfg = AutoConfig.from_pretrained(str(cfg_dir))
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, attn_implementation="sdpa")
    return ours, hf.eval()


def engine_tp_rows(a: argparse.Namespace, device: Any, dtype: Any) -> dict[str, Any]:
    """`Engine` at tp_size 1 and `a.tp_size` on one checkpoint: a cold round, then a warm one."""
    import torch

    from engine.engine import Engine

    g = torch.Generator().manual_seed(7)
    system = torch.randint(10, a.vocab, (a.batch_prompt_tokens,), generator=g).tolist()
    users = [torch.randint(10, a.vocab, (32,), generator=g).tolist()
             for _ in range(a.batch_prompts)]
    params = {"max_new_tokens": a.decode_steps, "ignore_eos": True}
    rows: dict[str, Any] = {}
    outputs: dict[int, list[Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp) / "ckpt", a.hidden, a.layers, a.vocab)
        for tp in (1, a.tp_size):
            with Engine(model_path=str(path), tp_size=tp, page_size=a.page_size,
                        device=str(device), dtype=str(dtype).removeprefix("torch."),
                        max_total_tokens=16 * a.batch_prompts * (a.batch_prompt_tokens + 64),
                        enable_hierarchical_cache=True, random_seed=0) as e:
                e.generate(input_ids=[system[:16]], sampling_params={"max_new_tokens": 2})
                row: dict[str, Any] = {"tp_size": tp}
                outs = []
                cold = [system + u for u in users]
                for name, prompts in (("cold", cold), ("warm", None)):
                    if prompts is None:
                        prompts = [p + o + [11, 12, 13] for p, o in zip(cold, outs)]
                    steps0 = e.scheduler.forward_steps
                    coll0 = getattr(e.sync, "collectives", 0)
                    t0 = time.perf_counter()
                    res = e.generate(input_ids=prompts, sampling_params=params)
                    dt = time.perf_counter() - t0
                    steps = e.scheduler.forward_steps - steps0
                    outs = [r["output_ids"] for r in res]
                    outputs.setdefault(tp, []).append(outs)
                    tokens = sum(len(p) for p in prompts) + sum(len(o) for o in outs)
                    cached = sum(r["meta_info"]["cached_tokens"] for r in res)
                    row[name] = {
                        "seconds": dt, "tokens": tokens, "tok_s": tokens / dt,
                        "cached_tokens": cached, "forward_steps": steps,
                        "agreement_collectives_per_step":
                            (getattr(e.sync, "collectives", 0) - coll0) / max(1, steps),
                    }
                rows[f"engine_tp{tp}"] = row
                print(f"engine tp={tp}  cold {row['cold']['tok_s']:8.0f} tok/s  warm "
                      f"{row['warm']['tok_s']:8.0f} tok/s (cached {row['warm']['cached_tokens']}"
                      f")  collectives/step {row['warm']['agreement_collectives_per_step']:.1f}",
                      flush=True)
    n = f"engine_tp{a.tp_size}"
    rows[n]["outputs_equal_tp1"] = outputs[a.tp_size] == outputs[1]
    for name in ("cold", "warm"):
        rows[n][f"{name}_ratio_vs_tp1"] = rows[n][name]["tok_s"] / rows["engine_tp1"][name]["tok_s"]
    print(f"engine tp={a.tp_size} / tp=1: cold {rows[n]['cold_ratio_vs_tp1']:.2f}x, warm "
          f"{rows[n]['warm_ratio_vs_tp1']:.2f}x, greedy outputs equal: "
          f"{rows[n]['outputs_equal_tp1']}", flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
