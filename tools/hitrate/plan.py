"""`hicache-hitrate plan TRACE ...`: the cheapest host-memory and storage sizes that meet a
target, and the frontier of cost against TTFT saved.

Under write-through the tiers are inclusive (every page on the device is also in host memory,
every page in host memory also in storage), so with LRU a tier of capacity C holds the C most
recently used pages and the hits of a (device D, host H, storage S) point follow from one
stack-distance pass: device hits = hits(D), host hits = hits(max(D, H)) - hits(D), storage hits
= hits(max(D, H, S)) - hits(max(D, H)). That prices the whole grid at once (the fast estimate);
the recommended point and its grid neighbours are then replayed exactly through `HiRadixCache`
and printed beside the estimate. See docs/hitrate.md, "Capacity planning".
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import replace
from typing import Any

from hicache_client import units
from hicache_client.errors import ConfigError
from tools.hitrate.cost import ttft_saved
from tools.hitrate.options import add_model_args, add_trace_args
from tools.hitrate.sizes import to_pages
from tools.hitrate.sweep import parse_sizes

logger = logging.getLogger(__name__)

SCHEMA = "hicache-hitrate-plan/1"
KINDS = ("nvme", "shared")  # the storage tier: a local NVMe drive or a shared store
GiB = 2**30


def build_plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hicache-hitrate plan",
        description="Capacity planning: prices a grid of host-memory (L2) and storage (L3) "
        "sizes from one stack-distance pass over the trace (tiers inclusive under "
        "write-through, LRU), prints the cheapest sizes meeting a target and the frontier of "
        "cost against TTFT saved, and confirms the recommended point and its grid neighbours "
        "with exact replays through HiRadixCache. Sizes as in 'hicache-hitrate --help'; "
        "prices in any currency per GiB (of KV as stored: per rank with --tp).",
    )
    add_trace_args(p)
    g = p.add_argument_group("cache")
    g.add_argument("--page-size", type=int, metavar="TOKENS",
                   help="tokens per page (default: the block size for block traces, else 32)")
    g.add_argument("--device", required=True, metavar="SIZE",
                   help="device (L1) KV capacity, e.g. 40GiB (required; not priced)")
    g.add_argument("--host", default="0,16GiB:2TiB:x2", metavar="SIZES",
                   help="host-memory sizes to price: a list / range (default 0,16GiB:2TiB:x2)")
    g.add_argument("--storage", default="0,256GiB:64TiB:x2", metavar="SIZES",
                   help="storage sizes to price, for each storage kind priced "
                   "(default 0,256GiB:64TiB:x2)")
    add_model_args(g)
    g.add_argument("--eviction-policy", default="lru", metavar="NAME",
                   help="eviction policy of the exact replays (the estimate is LRU; default lru)")
    g.add_argument("--warmup", type=float, default=0.0, metavar="FRACTION",
                   help="the first FRACTION of requests fills the cache and is not counted "
                   "(default 0)")
    g = p.add_argument_group("prices and speeds")
    g.add_argument("--host-price-per-gib", type=float, required=True, metavar="PRICE",
                   help="price of one GiB of host DRAM (required)")
    g.add_argument("--nvme-price-per-gib", type=float, metavar="PRICE",
                   help="price of one GiB of local NVMe as the storage tier (omit: not "
                   "considered)")
    g.add_argument("--shared-price-per-gib", type=float, metavar="PRICE",
                   help="price of one GiB of a shared store (Mooncake, 3FS, hicache-server) as "
                   "the storage tier (omit: not considered)")
    g.add_argument("--host-bandwidth", required=True, metavar="BYTES_PER_S",
                   help="host -> device bandwidth in bytes/s, e.g. 25GB or 25e9 (required)")
    g.add_argument("--nvme-bandwidth", metavar="BYTES_PER_S",
                   help="NVMe -> device bandwidth (required with --nvme-price-per-gib)")
    g.add_argument("--shared-bandwidth", metavar="BYTES_PER_S",
                   help="shared store -> device bandwidth (required with --shared-price-per-gib)")
    g.add_argument("--prefill-tokens-per-s", type=float, required=True, metavar="N",
                   help="the GPU's prefill rate at the model's shape, tokens/s (required)")
    g = p.add_argument_group("target (one of)")
    t = g.add_mutually_exclusive_group(required=True)
    t.add_argument("--target-hit-rate", type=float, metavar="RATE",
                   help="cheapest point whose token hit rate reaches RATE (e.g. 0.4)")
    t.add_argument("--target-ttft-saved", type=float, metavar="SECONDS",
                   help="cheapest point saving at least SECONDS of TTFT a request (e.g. 0.05)")
    t.add_argument("--budget", type=float, metavar="PRICE",
                   help="the point saving the most TTFT a request at a cost of at most PRICE")
    g = p.add_argument_group("output")
    g.add_argument("--confirm", type=int, default=1, metavar="N",
                   help="exact replays of the recommended point and its grid neighbours up to N "
                   "steps along each tier (default 1; 0: the recommended point only)")
    g.add_argument("--json", action="store_true", help="print the JSON document instead of tables")
    g.add_argument("--plot", metavar="PNG", help="write the cost / TTFT-saved frontier as a PNG")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def _bandwidth(text: str | None, flag: str) -> float | None:
    if text is None:
        return None
    try:
        bw = float(text)
    except ValueError:
        bw = float(units.parse_bytes(text, what=flag))
    if bw <= 0:
        raise ConfigError(f"{flag} must be > 0, got {text!r}")
    return bw


def _validate(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """The storage kinds priced: kind -> (price per GiB, bandwidth)."""
    if args.prefill_tokens_per_s <= 0:
        raise ConfigError("--prefill-tokens-per-s must be > 0")
    if args.host_price_per_gib < 0:
        raise ConfigError("--host-price-per-gib must be >= 0")
    if not 0.0 <= args.warmup < 1.0:
        raise ConfigError(f"--warmup must be a fraction in [0, 1), got {args.warmup}")
    if args.confirm < 0:
        raise ConfigError(f"--confirm must be >= 0, got {args.confirm}")
    if args.target_hit_rate is not None and not 0.0 < args.target_hit_rate <= 1.0:
        raise ConfigError(f"--target-hit-rate must be in (0, 1], got {args.target_hit_rate}")
    kinds: dict[str, tuple[float, float]] = {}
    for kind in KINDS:
        price = getattr(args, f"{kind}_price_per_gib")
        bw = _bandwidth(getattr(args, f"{kind}_bandwidth"), f"--{kind}-bandwidth")
        if price is None:
            continue
        if price < 0:
            raise ConfigError(f"--{kind}-price-per-gib must be >= 0")
        if bw is None:
            raise ConfigError(f"--{kind}-price-per-gib needs --{kind}-bandwidth")
        kinds[kind] = (price, bw)
    return kinds


def estimate(stack: Any, dev: int, host: int, sto: int) -> tuple[int, int, int]:
    """(device, host, storage) hit tokens of a point from the LRU stack distances, the tiers
    inclusive (a tier of capacity C holds the C most recent pages)."""
    d = stack.hit_tokens(dev)
    l2 = max(dev, host)
    h = stack.hit_tokens(l2) - d
    s = stack.hit_tokens(max(l2, sto)) - d - h
    return d, h, s


def frontier(points: list[dict[str, Any]]) -> list[int]:
    """Indices of the points no cheaper point beats on TTFT saved, by cost."""
    order = sorted(range(len(points)),
                   key=lambda i: (points[i]["cost"], -points[i]["ttft_saved_per_request_s"]))
    out: list[int] = []
    best = float("-inf")
    for i in order:
        if points[i]["ttft_saved_per_request_s"] > best + 1e-12:
            out.append(i)
            best = points[i]["ttft_saved_per_request_s"]
    return out


def choose(points: list[dict[str, Any]], args: argparse.Namespace) -> int | None:
    """The recommended point's index (None: no point meets the target)."""
    if args.budget is not None:
        ok = [i for i, p in enumerate(points) if p["cost"] <= args.budget]
        return max(ok, key=lambda i: (points[i]["ttft_saved_per_request_s"], -points[i]["cost"]),
                   default=None)
    if args.target_hit_rate is not None:
        ok = [i for i, p in enumerate(points) if p["hit_rate"] >= args.target_hit_rate]
    else:
        ok = [i for i, p in enumerate(points)
              if p["ttft_saved_per_request_s"] >= args.target_ttft_saved]
    return min(ok, key=lambda i: (points[i]["cost"], -points[i]["ttft_saved_per_request_s"]),
               default=None)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tools.hitrate import fast
    from tools.hitrate.inputs import kv_bytes_option, read_arrays, storage_kv_bytes
    from tools.hitrate.simulate import TierConfig, replay_arrays

    kinds = _validate(args)
    kvb = kv_bytes_option(args)
    if not kvb:
        raise ConfigError("plan needs the KV bytes per token: --model NAME, --model-path DIR or "
                          "--kv-bytes-per-token N")
    host_bw = _bandwidth(args.host_bandwidth, "--host-bandwidth")
    specs = {f: parse_sizes(getattr(args, f), f"--{f}") for f in ("device", "host", "storage")}
    if len(specs["device"]) != 1 or specs["device"][0] is None:
        raise ConfigError("plan: --device is one finite size")
    for f in ("host", "storage"):
        if any(s is None for s in specs[f]):
            raise ConfigError(f"plan: --{f} sizes must be finite (an unbounded tier has no price)")
    trace, arrs, notes, _, t_read = read_arrays(args)
    ps = arrs.page_size
    dev = to_pages(specs["device"][0], ps, kvb, "--device")
    hosts = sorted({to_pages(s, ps, kvb, "--host") for s in specs["host"]})  # type: ignore[type-var]
    l3kvb = storage_kv_bytes(args, kvb)  # --codec / --codec-ratio
    stos = sorted({to_pages(s, ps, l3kvb, "--storage") for s in specs["storage"]})  # type: ignore[type-var]
    assert dev is not None
    if any(s for s in stos) and not kinds:
        raise ConfigError("plan: --storage sizes above 0 need --nvme-price-per-gib and/or "
                          "--shared-price-per-gib (with their bandwidths); or --storage 0")

    dropped = [h for h in hosts if h and h <= dev]
    if dropped:
        # Storage hits are staged through host memory, which write-through fills with the
        # device's own pages when it is no larger: the replay then finds no room to prefetch
        # (SGLang likewise requires a host pool larger than the device's, hicache-ratio > 1).
        hosts = [h for h in hosts if h not in dropped]
        notes.append(f"{len(dropped)} --host size(s) at or below the device size left out: "
                     "host memory must be larger than the device pool")
    if not hosts:
        raise ConfigError("plan: no --host size left (0, or larger than --device)")
    t0 = time.perf_counter()
    stack = fast.stack_distances(arrs, warmup=args.warmup)
    n_in, n_req = stack.input_tokens, max(1, stack.requests)
    gib_per_page = ps * kvb / GiB
    points: list[dict[str, Any]] = []
    for hi, host in enumerate(hosts):
        assert host is not None
        for si, sto in enumerate(stos):
            assert sto is not None
            for kind in (kinds if sto else {"none": (0.0, 0.0)}):
                price, bw = kinds.get(kind, (0.0, 0.0))
                d, h, s = estimate(stack, dev, host, sto)
                sv = ttft_saved(d, h, s, args.prefill_tokens_per_s, kvb, host_bw, bw or None,
                                clamp=True)
                points.append({
                    "host_pages": host, "storage_pages": sto, "storage_kind": kind,
                    "host_gib": host * gib_per_page, "storage_gib": sto * gib_per_page,
                    "cost": host * gib_per_page * args.host_price_per_gib
                    + sto * gib_per_page * price,
                    "device_hit_tokens": d, "host_hit_tokens": h, "storage_hit_tokens": s,
                    "hit_rate": (d + h + s) / n_in if n_in else 0.0,
                    "ttft_saved_per_request_s": sv.ttft_s / n_req,
                    "_at": (hi, si),
                })
    t_est = time.perf_counter() - t0
    front = frontier(points)
    rec = choose(points, args)

    confirm: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    if rec is not None:
        rh, rs = points[rec]["_at"]
        kind = points[rec]["storage_kind"]
        near = []
        for i, p in enumerate(points):
            hi, si = p["_at"]
            same_kind = p["storage_kind"] == kind or "none" in (kind, p["storage_kind"])
            if same_kind and ((hi == rh and abs(si - rs) <= args.confirm)
                              or (si == rs and abs(hi - rh) <= args.confirm)):
                near.append(i)
        base = TierConfig(page_size=ps, device_pages=dev, host_pages=0, storage_pages=0,
                          write_policy="write_through", eviction_policy=args.eviction_policy)
        for i in sorted(near, key=lambda i: points[i]["cost"]):
            p = points[i]
            sim = replay_arrays(arrs, replace(base, host_pages=p["host_pages"],
                                              storage_pages=p["storage_pages"]),
                                progress=False if args.no_progress else None,
                                warmup=args.warmup)
            sto_bw = kinds.get(p["storage_kind"], (0.0, 0.0))[1] or None
            sv = ttft_saved(sim.device_hit_tokens, sim.host_hit_tokens, sim.storage_hit_tokens,
                            args.prefill_tokens_per_s, kvb, host_bw, sto_bw, clamp=True)
            confirm.append({
                "point": i, "recommended": i == rec,
                "host_gib": p["host_gib"], "storage_gib": p["storage_gib"],
                "storage_kind": p["storage_kind"], "cost": p["cost"],
                "estimate_hit_rate": p["hit_rate"],
                "exact_hit_rate": sim.hit_tokens / sim.input_tokens if sim.input_tokens else 0.0,
                "estimate_ttft_saved_per_request_s": p["ttft_saved_per_request_s"],
                "exact_ttft_saved_per_request_s": sv.ttft_s / max(1, sim.requests),
                "exact_device_hit_tokens": sim.device_hit_tokens,
                "exact_host_hit_tokens": sim.host_hit_tokens,
                "exact_storage_hit_tokens": sim.storage_hit_tokens,
            })
    t_exact = time.perf_counter() - t0
    for p in points:
        p.pop("_at")
    if rec is None:
        notes.append("no point of the grid meets the target: widen --host / --storage")
    return {
        "schema": SCHEMA,
        "trace": {"path": trace.path, "format": trace.format, "requests": arrs.requests,
                  "measured_requests": stack.requests, "input_tokens": n_in},
        "inputs": {
            "page_size": ps, "kv_bytes_per_token": kvb, "model": args.model or args.model_path,
            "kv_dtype": args.kv_dtype, "tp": args.tp, "device_pages": dev,
            "device_gib": dev * gib_per_page, "host_price_per_gib": args.host_price_per_gib,
            "host_bandwidth": host_bw,
            "storage_kinds": {k: {"price_per_gib": v[0], "bandwidth": v[1]}
                              for k, v in kinds.items()},
            "prefill_tokens_per_s": args.prefill_tokens_per_s,
            "eviction_policy": args.eviction_policy, "warmup": args.warmup,
            "target": {"hit_rate": args.target_hit_rate,
                       "ttft_saved_per_request_s": args.target_ttft_saved,
                       "budget": args.budget},
        },
        "points": points,
        "frontier": front,
        "recommended": rec,
        "confirm": confirm,
        "timing": {"read_s": t_read, "estimate_s": t_est, "exact_s": t_exact},
        "notes": notes,
    }


def _size(gib: float) -> str:
    from tools.hitrate.report import _fmt_bytes

    return "0" if gib == 0 else _fmt_bytes(gib * GiB)


def print_plan(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    inp, pts = doc["inputs"], doc["points"]
    con.print(
        f"[bold]{doc['trace']['path']}[/]: {doc['trace']['measured_requests']:,} requests "
        f"measured, {doc['trace']['input_tokens']:,} input tokens; device {_size(inp['device_gib'])}"
        f", kv bytes/token {inp['kv_bytes_per_token']:g}; {len(pts)} grid points from one "
        "stack-distance pass"
    )
    t = Table(title="frontier: cost against TTFT saved (estimate)", header_style="bold")
    for col in ("cost", "host", "storage", "hit rate", "TTFT saved/req"):
        t.add_column(col, justify="right")
    for i in doc["frontier"]:
        p = pts[i]
        sto = _size(p["storage_gib"]) + ("" if p["storage_kind"] == "none"
                                         else f" {p['storage_kind']}")
        mark = " *" if i == doc["recommended"] else ""
        t.add_row(f"{p['cost']:,.2f}{mark}", _size(p["host_gib"]), sto,
                  f"{100 * p['hit_rate']:.2f}%", f"{1000 * p['ttft_saved_per_request_s']:.2f} ms")
    con.print(t)
    rec = doc["recommended"]
    if rec is None:
        con.print("[red]no point of the grid meets the target[/]")
    else:
        p = pts[rec]
        con.print(
            f"recommended: host {_size(p['host_gib'])}, storage {_size(p['storage_gib'])}"
            f"{'' if p['storage_kind'] == 'none' else ' ' + p['storage_kind']}, cost "
            f"[bold]{p['cost']:,.2f}[/]: hit rate {100 * p['hit_rate']:.2f}%, TTFT saved "
            f"{1000 * p['ttft_saved_per_request_s']:.2f} ms a request (estimate)"
        )
    if doc["confirm"]:
        c = Table(title="exact replays (HiRadixCache) beside the estimate", header_style="bold")
        for col in ("host", "storage", "cost", "hit rate est", "exact", "TTFT/req est", "exact"):
            c.add_column(col, justify="right")
        for r in doc["confirm"]:
            c.add_row(_size(r["host_gib"]) + (" *" if r["recommended"] else ""),
                      _size(r["storage_gib"]), f"{r['cost']:,.2f}",
                      f"{100 * r['estimate_hit_rate']:.2f}%", f"{100 * r['exact_hit_rate']:.2f}%",
                      f"{1000 * r['estimate_ttft_saved_per_request_s']:.2f} ms",
                      f"{1000 * r['exact_ttft_saved_per_request_s']:.2f} ms")
        con.print(c)
    for note in doc["notes"]:
        con.print(f"[dim]note: {note}[/]")


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = doc["points"]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.scatter([p["cost"] for p in pts], [1000 * p["ttft_saved_per_request_s"] for p in pts],
               s=8, color="0.7", label="grid (estimate)")
    fr = [pts[i] for i in doc["frontier"]]
    ax.step([p["cost"] for p in fr], [1000 * p["ttft_saved_per_request_s"] for p in fr],
            where="post", color="C0", label="frontier")
    if doc["confirm"]:
        ax.scatter([r["cost"] for r in doc["confirm"]],
                   [1000 * r["exact_ttft_saved_per_request_s"] for r in doc["confirm"]],
                   marker="x", color="C1", label="exact replay")
    if doc["recommended"] is not None:
        p = pts[doc["recommended"]]
        ax.scatter([p["cost"]], [1000 * p["ttft_saved_per_request_s"]], marker="*", s=200,
                   color="C3", label="recommended")
    ax.set_xlabel("cost (host + storage)")
    ax.set_ylabel("TTFT saved a request (ms)")
    ax.set_title("hicache-hitrate plan")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    from tools.hitrate.inputs import run_command
    from tools.hitrate.report import write_json

    args = build_plan_parser().parse_args(argv)
    doc = run_command("hicache-hitrate plan", args, run)
    if doc is None:
        return 2
    if args.plot:
        plot(doc, args.plot)
    if args.json:
        write_json(doc, sys.stdout)
    else:
        print_plan(doc)
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0
