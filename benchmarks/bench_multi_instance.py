"""Several engines behind the SGLang model gateway (`smg`), with and without one shared L3.

The multi-turn workload of `bench_multiturn.py` (users holding multi-turn conversations on one
shared system prompt; each turn's prompt is the whole history plus a new message) is played over
HTTP `/generate` (streamed: TTFT is measured by the client, through the gateway) against:

  single      one engine serving the whole workload (L1+L2+L3 on its own store): the reference
  rr          N engines behind `smg --policy round_robin`, L1+L2 only
  rr_l3       the same, all engines on one shared `hicache-server` (default prefetch threshold:
              256-token floor, shorter gaps admitted by the cost model)
  rr_l3_t256  rr_l3 with `prefetch_threshold` set to 256 explicitly (a hard floor: SGLang's
              default, and this project's behaviour before the cost model admitted short gaps)
  rr_l3_t64   rr_l3 with `prefetch_threshold` 64 (a hard floor)
  ca          N engines behind `smg --policy cache_aware`, L1+L2 only
  ca_l3       the same with the shared `hicache-server`

Two workloads (`--workload`):

  pressure    (default) 20 users, 6 turns, a 3,072-token device pool and 1.5x that in host
              memory per engine: each engine holds far less than the cluster's working set
              (write-through keeps a host copy of every device page, so an engine holds about
              4.6k distinct tokens against up to ~11k of histories), so the engine a user comes
              back to has evicted that user's history, as in production; without L3 round robin
              recomputes it. 20 users over 3 engines: a user's next turn lands on another
              engine. Host is larger than device on purpose: an L3 prefetch needs free host
              pages, and host eviction only drops pages that are off the device, so with
              host == device every prefetch is skipped for want of host room.
  small       the earlier configuration: 9 users, 6 turns, 8,192-token device pools (x2 host):
              every engine holds almost the whole working set, so round robin without L3
              recomputes only the 240 tokens a user is behind on the engine it returns to.

Every configuration starts fresh processes (engines, store, gateway) on loopback ports. Per
configuration: token hit rate per tier (summed over the engines' `/hicache/stats`), TTFT
p50/p90, requests per engine; then ratios side by side. JSON into
benchmarks/results/bench_multi_instance[_small][_quick].json.

    python benchmarks/bench_multi_instance.py [--workload pressure|small] [--quick] [--engines 3]

Run it inside the loopback-only namespace like the tests: `scripts/in_netns.sh python ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_multiturn import make_checkpoint, make_workload, write_report  # noqa: E402

TARGETS = {
    # cluster token hit rate / single engine's: at least this much
    "rr_l3_hit_rate_vs_single": (">=", 0.9),
    # TTFT p50 with the shared L3 / the same cluster without it: at most this much
    "rr_l3_p50_vs_rr": ("<=", 0.5),
}
DEFAULT_CONFIGS = "single,rr,rr_l3,rr_l3_t256"
# Per workload: (full, --quick) settings; anything given on the command line wins.
WORKLOADS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "pressure": (
        {"users": 20, "turns": 6, "system_tokens": 512, "user_tokens": 64, "hidden": 512,
         "layers": 4, "device_tokens": 3072, "host_ratio": 1.5},
        {"users": 14, "turns": 4, "system_tokens": 256, "user_tokens": 64, "hidden": 512,
         "layers": 2, "device_tokens": 2048, "host_ratio": 1.5},
    ),
    "small": (
        {"users": 9, "turns": 6, "system_tokens": 512, "user_tokens": 64, "hidden": 512,
         "layers": 4, "device_tokens": 8192, "host_ratio": 2.0},
        {"users": 6, "turns": 4, "system_tokens": 256, "user_tokens": 64, "hidden": 512,
         "layers": 2, "device_tokens": 8192, "host_ratio": 2.0},
    ),
}
CONFIGS = {
    "single": {"engines": 1, "policy": None, "l3": True},
    "rr": {"engines": None, "policy": "round_robin", "l3": False},
    "rr_l3": {"engines": None, "policy": "round_robin", "l3": True},
    "rr_l3_t256": {"engines": None, "policy": "round_robin", "l3": True,
                   "prefetch_threshold": 256},
    "rr_l3_t64": {"engines": None, "policy": "round_robin", "l3": True, "prefetch_threshold": 64},
    "ca": {"engines": None, "policy": "cache_aware", "l3": False},
    "ca_l3": {"engines": None, "policy": "cache_aware", "l3": True},
}


def stream_generate(client: httpx.Client, url: str, ids: list[int], n: int
                    ) -> tuple[float, list[int], int]:
    """One streamed /generate: (TTFT seconds, output ids, cached tokens)."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    t0 = time.perf_counter()
    ttft = None
    last: dict[str, Any] = {}
    with client.stream("POST", url + "/generate", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"]))
            if ttft is None and chunk.get("output_ids"):
                ttft = time.perf_counter() - t0
            last = chunk
    if ttft is None:
        raise RuntimeError("no token streamed")
    return ttft, list(last["output_ids"]), int(last["meta_info"]["cached_tokens"])


def play(url: str, system: list[int], users: list[list[list[int]]], a: argparse.Namespace
         ) -> dict[str, Any]:
    """Every user's turns in order; `a.concurrency` users at once; a user whose turn finished
    goes to the back of the queue (as in bench_multiturn)."""
    history = [list(system) for _ in users]
    todo: deque[tuple[int, int]] = deque((u, 0) for u in range(len(users)))
    lock = threading.Lock()
    ttfts: list[float] = []
    by_turn: dict[int, list[float]] = {}
    totals = {"prompt_tokens": 0, "cached_tokens": 0, "output_tokens": 0, "requests": 0}
    errors: list[str] = []

    def worker() -> None:
        with httpx.Client(timeout=600) as client:
            while True:
                with lock:
                    if not todo or errors:
                        return
                    u, r = todo.popleft()
                prompt = history[u] + users[u][r]
                try:
                    ttft, out, cached = stream_generate(client, url, prompt, a.output_tokens)
                except (httpx.HTTPError, RuntimeError) as e:
                    with lock:
                        errors.append(f"user {u} turn {r}: {e}")
                    return
                with lock:
                    ttfts.append(ttft)
                    by_turn.setdefault(r, []).append(ttft)
                    totals["prompt_tokens"] += len(prompt)
                    totals["cached_tokens"] += cached
                    totals["requests"] += 1
                    totals["output_tokens"] += len(out)
                    history[u] = prompt + out
                    if r + 1 < len(users[u]):
                        todo.append((u, r + 1))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors[:3]))
    ttfts.sort()
    q = statistics.quantiles(ttfts, n=10) if len(ttfts) > 1 else ttfts * 9
    wall = time.perf_counter() - t0
    return {"wall_s": round(wall, 3),
            "throughput_tok_s": round((totals["prompt_tokens"] + totals["output_tokens"]) / wall,
                                      1),
            "ttft_p50_s": round(statistics.median(ttfts), 4), "ttft_p90_s": round(q[8], 4),
            "ttft_mean_s": round(statistics.fmean(ttfts), 4),
            # turn 0 computes the new message alone everywhere; later turns show the reuse
            "ttft_p50_by_turn_s": {t: round(statistics.median(v), 4)
                                   for t, v in sorted(by_turn.items())},
            "computed_prompt_tokens": totals["prompt_tokens"] - totals["cached_tokens"],
            **totals}


def wait_idle(engines: list[Any], timeout: float = 300) -> list[dict[str, Any]]:
    """Stats of every engine once its transfers are done."""
    return [e.wait_transfers(timeout) for e in engines]


def run_config(name: str, spec: dict[str, Any], tmp: Path, model: Path, system: list[int],
               users: list[list[list[int]]], a: argparse.Namespace) -> dict[str, Any]:
    from tests.deployment.cluster import Gateway, start_engines
    from tests.storage_backends.hicache_server_proc import HiCacheServerProc

    work = tmp / name
    work.mkdir()
    n = spec["engines"] or a.engines
    flags = ["--model-path", str(model), "--page-size", str(a.page_size),
             "--max-total-tokens", str(a.device_tokens), "--hicache-ratio", str(a.host_ratio),
             "--max-running-requests", str(a.concurrency), "--context-length", "8192",
             "--chunked-prefill-size", "4096"]
    store = None
    engines: list[Any] = []
    gw = None
    try:
        if spec["l3"]:
            store = HiCacheServerProc(work, capacity="2GiB").start()
            extra: dict[str, Any] = {"url": store.url}
            threshold = spec.get("prefetch_threshold", a.prefetch_threshold)
            if threshold is not None:
                extra["prefetch_threshold"] = threshold
            flags = ["--enable-hierarchical-cache", "--hicache-storage-backend", "hicache",
                     "--hicache-storage-backend-extra-config", json.dumps(extra), *flags,
                     "--hicache-storage-prefetch-policy", a.prefetch]
        else:
            flags = ["--enable-hierarchical-cache", *flags]
        os.environ["OMP_NUM_THREADS"] = str(a.engine_threads)
        engines = start_engines(work, n, flags, name=name)
        url = engines[0].url
        if spec["policy"] is not None:
            gw = Gateway(work, [e.url for e in engines], spec["policy"])
            gw.start(n)
            url = gw.url
        res = play(url, system, users, a)
        stats = wait_idle(engines)
        hits = {t: sum(int(s[f"{t}_hit_tokens"]) for s in stats)
                for t in ("device", "host", "storage")}
        res["hit_tokens"] = hits
        res["hit_rate"] = round(sum(hits.values()) / res["prompt_tokens"], 4)
        res["hit_rate_per_tier"] = {t: round(h / res["prompt_tokens"], 4)
                                    for t, h in hits.items()}
        res["requests_per_engine"] = [int(s["scheduler"]["finished"]) for s in stats]
        res["storage_pages_written"] = sum(int(s["storage_backup_pages"]) for s in stats)
        # How the L3 prefetches went (summed over the engines)
        res["prefetch"] = {k: sum(int(s.get(f"prefetch_{k}", 0)) for s in stats)
                           for k in ("started", "skipped", "pages", "revoked_pages")}
        res["cost_model"] = [s.get("cost_model") for s in stats]  # each engine's measurements
        res["engines"] = n
        res["policy"] = spec["policy"]
        res["shared_l3"] = spec["l3"]
        return res
    finally:
        if gw is not None:
            gw.stop()
        for e in engines:
            e.stop()
        if store is not None:
            store.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="pressure",
                   help="pressure: per-engine memory well below the working set (default); "
                        "small: the earlier configuration, where it is not")
    p.add_argument("--quick", action="store_true", help="small model and workload")
    p.add_argument("--engines", type=int, default=3, help="engines behind the gateway")
    p.add_argument("--users", type=int, default=None,
                   help="conversations (default: the workload's)")
    p.add_argument("--turns", type=int, default=None,
                   help="turns per conversation (default: the workload's)")
    p.add_argument("--concurrency", type=int, default=3,
                   help="conversations in flight at once")
    p.add_argument("--system-tokens", type=int, default=None,
                   help="tokens of the system prompt all users share")
    p.add_argument("--user-tokens", type=int, default=None,
                   help="new prompt tokens per turn")
    p.add_argument("--output-tokens", type=int, default=16,
                   help="tokens generated per turn (they join the history)")
    p.add_argument("--hidden", type=int, default=None, help="model hidden size")
    p.add_argument("--layers", type=int, default=None, help="model layers")
    p.add_argument("--vocab", type=int, default=8192, help="model vocabulary size")
    p.add_argument("--page-size", type=int, default=32, help="tokens per KV page")
    p.add_argument("--device-tokens", type=int, default=None, help="device KV pool per engine")
    p.add_argument("--host-ratio", type=float, default=None,
                   help="host pool size / device pool size (--hicache-ratio)")
    p.add_argument("--prefetch", default="wait_complete",
                   help="--hicache-storage-prefetch-policy of the engines on L3")
    p.add_argument("--prefetch-threshold", type=int, default=None,
                   help="L3 prefetch threshold in tokens for the configs that do not set one "
                        "(default: unset, the engine's: 256 floor, shorter gaps by cost model)")
    p.add_argument("--engine-threads", type=int, default=1, help="OMP threads per engine")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help=f"comma-separated, from {', '.join(CONFIGS)}")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON output (default benchmarks/results/bench_multi_instance*.json)")
    a = p.parse_args(argv)
    for k, v in WORKLOADS[a.workload][1 if a.quick else 0].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.out is None:
        name = "bench_multi_instance" + ("_small" if a.workload == "small" else "") \
            + ("_quick" if a.quick else "") + ".json"
        a.out = ROOT / "benchmarks" / "results" / name
    with tempfile.TemporaryDirectory(prefix="bench-multi-instance-",
                                     ignore_cleanup_errors=True) as d:
        tmp = Path(d)
        model = make_checkpoint(tmp / "model", a.hidden, a.layers, a.vocab)
        system, users = make_workload(a)
        results: dict[str, Any] = {}
        load_before = os.getloadavg()
        for name in a.configs.split(","):
            r = results[name] = run_config(name, CONFIGS[name], tmp, model, system, users, a)
            print(f"{name:10s} ttft p50 {r['ttft_p50_s']:.3f}s p90 {r['ttft_p90_s']:.3f}s "
                  f"hit rate {r['hit_rate']:.3f} {r['hit_rate_per_tier']} "
                  f"per engine {r['requests_per_engine']} by turn {r['ttft_p50_by_turn_s']}",
                  flush=True)
        ratios: dict[str, float] = {}
        for name, r in results.items():
            if name != "single" and "single" in results:
                ratios[f"{name}_hit_rate_vs_single"] = round(
                    r["hit_rate"] / results["single"]["hit_rate"], 3)
            base = name.split("_l3")[0]
            if "_l3" in name and base in results:
                for q in ("p50", "p90"):
                    ratios[f"{name}_{q}_vs_{base}"] = round(
                        r[f"ttft_{q}_s"] / results[base][f"ttft_{q}_s"], 3)
        targets = {}
        for k, (op, v) in TARGETS.items():
            m = ratios.get(k)
            targets[k] = {"target": f"{op} {v}", "measured": m,
                          "met": None if m is None else (m >= v if op == ">=" else m <= v)}
        machine = {"platform": platform.platform(), "cpus": os.cpu_count(),
                   # 1-minute load average at the start and at the end of the run
                   "loadavg_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}
        write_report(a.out, "bench_multi_instance", a, machine, results=results, ratios=ratios,
                     targets=targets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
