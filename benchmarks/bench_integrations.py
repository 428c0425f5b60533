"""Our engine plugins against the engines' built-in L3 backends: get / set MB/s through each
engine's own storage interface, at 1 and 8 client processes, in one run.

Each plugin has a module `benchmarks/integrations_<plugin>.py` with `measure(args) -> rows`,
rows `{"plugin", "target", "builtin": bool, "op": "get"|"set", "clients", "page_bytes",
"mb_s": [per repeat], "mb_s_median"}`. This driver runs the plugins named, then adds per
(plugin, op, clients) the ratio of our target's median to the best built-in's, and writes one
JSON (`--out`) and a table.

    LMCACHE_TRACK_USAGE=false scripts/in_netns.sh .venv/bin/python \\
        benchmarks/bench_integrations.py --plugins sglang,lmcache --page-bytes 1MiB \\
        --clients 1,8 --seconds 2 --repeat 3

Mooncake binds every interface: run it inside the loopback-only namespace (`in_netns.sh`, as
above and in `make bench`); elsewhere the Mooncake targets are skipped with a note. A plugin
whose module is missing is reported and skipped.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

# Per plugin: our target (the one compared) and the other names it may report.
OURS = {"sglang": "hicache", "lmcache": "hicache"}
TARGET = 1.5  # our median / the best built-in's, per (op, clients)


def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (plugin, op, clients, page_bytes): our median over the best built-in median."""
    out = []
    for r in rows:
        if r["builtin"] or r["target"] != OURS.get(r["plugin"], "hicache"):
            continue
        peers = [b for b in rows if b["builtin"] and b["plugin"] == r["plugin"]
                 and (b["op"], b["clients"], b["page_bytes"]) ==
                 (r["op"], r["clients"], r["page_bytes"]) and b["mb_s_median"] > 0]
        if not peers:
            continue
        best = max(peers, key=lambda b: b["mb_s_median"])
        ratio = r["mb_s_median"] / best["mb_s_median"]
        out.append({"plugin": r["plugin"], "op": r["op"], "clients": r["clients"],
                    "page_bytes": r["page_bytes"], "ours": r["target"],
                    "ours_mb_s": r["mb_s_median"], "best_builtin": best["target"],
                    "builtin_mb_s": best["mb_s_median"], "ratio": round(ratio, 2),
                    "target": TARGET, "met": ratio >= TARGET})
    out.sort(key=lambda x: (x["plugin"], x["clients"], x["op"]))
    return out


def print_table(rows: list[dict[str, Any]], ratios: list[dict[str, Any]]) -> None:
    head = f"{'plugin':<8} {'cl':>3} {'op':<4} {'target':<12} {'builtin':<8} {'MB/s median':>12}  per repeat"
    print(head)
    print("-" * len(head))
    for r in sorted(rows, key=lambda r: (r["plugin"], r["clients"], r["op"], r["builtin"],
                                         r["target"])):
        miss = f"  misses {r['misses']}" if any(r.get("misses") or []) else ""
        print(f"{r['plugin']:<8} {r['clients']:>3} {r['op']:<4} {r['target']:<12} "
              f"{'yes' if r['builtin'] else 'no':<8} {r['mb_s_median']:>12.1f}  {r['mb_s']}{miss}")
    if ratios:
        print()
        for x in ratios:
            print(f"{x['plugin']:<8} {x['op']:<4} x{x['clients']}: {x['ours']} "
                  f"{x['ours_mb_s']:.0f} MB/s / {x['best_builtin']} {x['builtin_mb_s']:.0f} MB/s"
                  f" = {x['ratio']:.2f}x ({'meets' if x['met'] else 'below'} {TARGET}x)")


def main(argv: Sequence[str] | None = None) -> int:
    from hicache_client.units import parse_bytes

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plugins", default="sglang,lmcache", help="comma list: sglang, lmcache")
    p.add_argument("--clients", default="1,8", help="client processes, e.g. 1,8")
    p.add_argument("--page-bytes", default="1MiB", help="bytes of KV per page (chunk)")
    p.add_argument("--seconds", type=float, default=2.0, help="time per op per run")
    p.add_argument("--repeat", type=int, default=3, help="runs per config; median reported")
    p.add_argument("--working-set-mb", type=int, default=128,
                   help="pages held by all clients of a run together")
    p.add_argument("--sglang-targets", default="", help="subset of the sglang targets")
    p.add_argument("--lmcache-targets", default="", help="subset of the lmcache targets")
    p.add_argument("--quick", action="store_true", help="1 repeat of 1 s (make bench)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" /
                                        "bench_integrations.json"))
    a = p.parse_args(argv)
    if a.quick:
        a.repeat, a.seconds = 1, min(a.seconds, 1.0)
        if a.out == p.get_default("out"):
            a.out = str(REPO / "benchmarks" / "results" / "bench_integrations_quick.json")
    args = argparse.Namespace(
        clients=[int(c) for c in a.clients.split(",") if c],
        page_bytes=parse_bytes(a.page_bytes, what="--page-bytes"), seconds=a.seconds,
        repeat=a.repeat, working_set_mb=a.working_set_mb,
        sglang_targets=[t for t in a.sglang_targets.split(",") if t],
        lmcache_targets=[t for t in a.lmcache_targets.split(",") if t])
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    t0 = time.time()
    for plugin in [x for x in a.plugins.split(",") if x]:
        try:
            mod = importlib.import_module(f"benchmarks.integrations_{plugin}")
        except ImportError as e:
            skipped[plugin] = f"no benchmarks/integrations_{plugin}.py ({e})"
            print(f"skipping {plugin}: {skipped[plugin]}", file=sys.stderr)
            continue
        print(f"{plugin}...", file=sys.stderr)
        try:
            rows += mod.measure(args)
        except Exception as e:  # noqa: BLE001 - one plugin's failure does not lose the rest
            skipped[plugin] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
    ratios = add_ratios(rows)
    from benchmarks.common import host, save_json

    print_table(rows, ratios)
    save_json(a.out, {"benchmark": "bench_integrations", "args": vars(a), "host": host(),
                      "started_unix": t0, "seconds": time.time() - t0, "rows": rows,
                      "ratios": ratios, "skipped": skipped})
    return 1 if skipped and not rows else 0


if __name__ == "__main__":
    sys.exit(main())
