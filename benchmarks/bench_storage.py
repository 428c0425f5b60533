"""L3 storage benchmark: every backend next to its raw baseline, measured in the same run.

For each target (benchmarks/storage_targets/*.py: `TARGETS`), record size and client count it
measures batch_set / batch_exists / batch_get throughput (MB/s, pages/s) and p50 / p99 batch
latency. Clients are separate processes (fork), each with its own working set of valid page
records (hicache_client.backend.PageCodec), cycling over it for `--seconds` (or `--batches`) per
operation; operations run in the order set, exists, get, every client starting each one at a
barrier. Targets run interleaved per (size, clients) and `--repeat` times; the reported number
is the median over repeats, and each backend is reported as a ratio of its raw baseline.

    python benchmarks/bench_storage.py                      # all targets, 64K/1M/4M, 1 and 8 clients
    python benchmarks/bench_storage.py --quick              # a minute or two
    python benchmarks/bench_storage.py --targets file --sizes 1M --clients 1 --seconds 3

JSON goes to --out (default benchmarks/results/bench_storage.json); a table goes to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import multiprocessing as mp
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# The repository first, even when an editable install already lists it (last): otherwise a
# `tests` package some wheel puts in site-packages shadows ours (tests.storage_backends).
sys.path[:] = [str(REPO)] + [p for p in sys.path if p != str(REPO)]

from hicache_client.units import parse_bytes  # noqa: E402

OPS = ("set", "exists", "get")
# Other people's stores every target is compared with, in the same run: the best of those
# measured is each row's `best_anchor` (`ratio_to_best_anchor` = target MB/s / anchor MB/s).
ANCHORS = ("lmcache", "lmcache-server-raw", "mooncake", "redis")
MiB = 1 << 20


def parse_size(s: str) -> int:
    return parse_bytes(s, what="--sizes")


def fmt_size(n: int) -> str:
    for unit, m in (("M", MiB), ("K", 1 << 10)):
        if n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


@dataclass
class Plan:
    """What one (target, size, clients) run does."""

    record_bytes: int
    clients: int
    batch_pages: int
    working_set_pages: int  # per client
    seconds: float
    batches: int  # > 0: exactly this many batches per op per client (overrides seconds)


@dataclass
class OpResult:
    target: str
    baseline_of: str | None
    op: str
    record_bytes: int
    clients: int
    batch_pages: int
    repeat: int
    pages: int = 0
    bytes: int = 0
    seconds: float = 0.0
    misses: int = 0  # get: pages not returned; exists: pages not reported present
    latencies_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def mb_s(self) -> float:
        return self.bytes / MiB / self.seconds if self.seconds > 0 else 0.0

    @property
    def pages_s(self) -> float:
        return self.pages / self.seconds if self.seconds > 0 else 0.0


# --------------------------------------------------------------------------------------------
# One client process
# --------------------------------------------------------------------------------------------


def _keys(client: int, n: int) -> list[str]:
    return [hashlib.sha256(f"bench/{client}/{i}".encode()).hexdigest() for i in range(n)]


def _records(client: int, keys: list[str], record_bytes: int) -> tuple[bytearray, list[memoryview]]:
    """Valid records for `keys` in one block (a host pool stand-in)."""
    import numpy as np

    from benchmarks.storage_targets import BENCH_NAMESPACE
    from hicache_client.codec import HEADER_BYTES, PageCodec

    codec = PageCodec(namespace=BENCH_NAMESPACE, dtype="uint8", shape=(record_bytes - HEADER_BYTES,),
                      layout="raw", tokens_per_page=1, itemsize=1)
    block = bytearray(record_bytes * len(keys))
    views = [memoryview(block)[i * record_bytes : (i + 1) * record_bytes] for i in range(len(keys))]
    rng = np.random.default_rng(client)
    payload = rng.integers(0, 256, size=codec.payload_bytes, dtype=np.uint8)
    for i, (k, v) in enumerate(zip(keys, views)):
        payload[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
        codec.encode_into(k, payload, v)
    return block, views


def _client_main(factory: Callable[[], Any], plan: Plan, client: int, barrier: Any,
                 queue: Any) -> None:
    try:
        keys = _keys(client, plan.working_set_pages)
        _block, values = _records(client, keys, plan.record_bytes)
        out_block = bytearray(plan.record_bytes * plan.batch_pages)
        out = [memoryview(out_block)[i * plan.record_bytes : (i + 1) * plan.record_bytes]
               for i in range(plan.batch_pages)]
        bp = plan.batch_pages
        batches = [(keys[i : i + bp], values[i : i + bp]) for i in range(0, len(keys), bp)]
        c = factory()
        result: dict[str, Any] = {}
        for op in OPS:
            barrier.wait(timeout=600)
            lat: list[float] = []
            pages = misses = 0
            t0 = time.perf_counter()
            deadline = t0 + plan.seconds
            i = 0
            while True:
                if plan.batches:
                    if i >= plan.batches:
                        break
                elif time.perf_counter() >= deadline and (op != "set" or i >= len(batches)):
                    break  # a set pass always covers the working set once
                ks, vs = batches[i % len(batches)]
                s = time.perf_counter()
                if op == "set":
                    c.put(ks, vs)
                elif op == "exists":
                    misses += len(ks) - c.exists(ks)
                else:
                    misses += len(ks) - c.get(ks, out[: len(ks)])
                lat.append(time.perf_counter() - s)
                pages += len(ks)
                i += 1
            result[op] = {"start": t0, "end": time.perf_counter(), "pages": pages,
                          "misses": misses, "lat": lat}
        c.close()
        queue.put((client, result, ""))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        client_failed(client, e, barrier, queue)


def client_failed(client: int, e: BaseException, barrier: Any, queue: Any) -> None:
    """In a `run_clients` client that raised `e`: report it, and release the others from the
    barrier (they would wait for this client until their timeout)."""
    queue.put((client, {}, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    with contextlib.suppress(Exception):
        barrier.abort()


def run_clients(
    target: Callable[..., None], args: tuple[Any, ...], clients: int, timeout_s: float
) -> tuple[list[dict[str, Any]], list[str]]:
    """Fork `clients` processes `target(*args, client, barrier, queue)`; each puts `(client,
    result, error)` on the queue once. Their results and errors (a client that died: one)."""
    ctx = mp.get_context("fork")
    barrier, queue = ctx.Barrier(clients), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, c, barrier, queue), daemon=True)
             for c in range(clients)]
    for p in procs:
        p.start()
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(results) + len(errors) < clients and time.monotonic() < deadline:
        try:
            _c, res, err = queue.get(timeout=5)
        except Exception:  # noqa: BLE001 - queue.Empty
            if not any(p.is_alive() for p in procs):
                errors.append("client processes died")
                break
            continue
        (errors.append(err) if err else results.append(res))
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return results, errors


def run_one(name: str, baseline_of: str | None, factory: Callable[[], Any], plan: Plan,
            repeat: int) -> list[OpResult]:
    """Run `plan.clients` forked client processes against one started target."""
    per_client, errors = run_clients(_client_main, (factory, plan), plan.clients, 3600)
    results = []
    for op in OPS:
        r = OpResult(name, baseline_of, op, plan.record_bytes, plan.clients, plan.batch_pages,
                     repeat)
        if errors:
            r.error = errors[0].splitlines()[0]
            print(f"  ! {name} {op}: {errors[0]}", file=sys.stderr)
        elif per_client:
            parts = [pc[op] for pc in per_client]
            r.pages = sum(p["pages"] for p in parts)
            r.bytes = r.pages * plan.record_bytes
            r.seconds = max(p["end"] for p in parts) - min(p["start"] for p in parts)
            r.misses = sum(p["misses"] for p in parts)
            r.latencies_s = [x for p in parts for x in p["lat"]]
        results.append(r)
    return results


# --------------------------------------------------------------------------------------------
# Modes
# --------------------------------------------------------------------------------------------


def _pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def summarise(
    results: list[OpResult], marks: dict[str, tuple[str, ...]] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Median over repeats per (target, op, size, clients); ratios backend / baseline (and
    target / X for targets marked ``vs:X``)."""
    groups: dict[tuple[str, str, int, int], list[OpResult]] = {}
    for r in results:
        groups.setdefault((r.target, r.op, r.record_bytes, r.clients), []).append(r)
    rows: list[dict[str, Any]] = []
    for (target, op, size, clients), rs in groups.items():
        ok = [r for r in rs if not r.error]
        lat = [x for r in ok for x in r.latencies_s]
        rows.append({
            "target": target,
            "baseline_of": rs[0].baseline_of,
            "op": op,
            "record_bytes": size,
            "clients": clients,
            "batch_pages": rs[0].batch_pages,
            "repeats": len(ok),
            "mb_s": statistics.median(r.mb_s for r in ok) if ok else 0.0,
            "pages_s": statistics.median(r.pages_s for r in ok) if ok else 0.0,
            "mb_s_each": [round(r.mb_s, 1) for r in ok],
            "p50_ms": _pct(lat, 0.50) * 1e3,
            "p99_ms": _pct(lat, 0.99) * 1e3,
            "batches": len(lat),
            "misses": sum(r.misses for r in ok),
            "error": next((r.error for r in rs if r.error), ""),
        })
    by_key = {(r["target"], r["op"], r["record_bytes"], r["clients"]): r for r in rows}
    pairs: list[tuple[str, str]] = []  # (measured, reference)
    for r in rows:
        if r["baseline_of"] is not None:
            pairs.append((r["baseline_of"], r["target"]))
    for name, ms in (marks or {}).items():
        pairs += [(name, m[3:]) for m in ms if m.startswith("vs:")]
    ratios: list[dict[str, Any]] = []
    for measured, reference in sorted(set(pairs)):
        for (target, op, size, clients), row in by_key.items():
            if target != measured:
                continue
            ref = by_key.get((reference, op, size, clients))
            if ref is None:
                continue
            ratio = row["mb_s"] / ref["mb_s"] if ref["mb_s"] else 0.0
            row["baseline"] = reference
            row["ratio_to_baseline"] = ratio
            ratios.append({"target": measured, "baseline": reference, "op": op,
                           "record_bytes": size, "clients": clients, "ratio": ratio})
    ratios.sort(key=lambda r: (r["target"], r["record_bytes"], r["clients"], r["op"]))
    for row in rows:
        anchors = [
            by_key[(a, row["op"], row["record_bytes"], row["clients"])]
            for a in ANCHORS
            if a != row["target"] and (a, row["op"], row["record_bytes"], row["clients"]) in by_key
        ]
        anchors = [a for a in anchors if a["mb_s"] > 0]
        if anchors and row["target"] not in ANCHORS:
            best = max(anchors, key=lambda a: a["mb_s"])
            row["best_anchor"] = best["target"]
            row["ratio_to_best_anchor"] = row["mb_s"] / best["mb_s"]
    rows.sort(key=lambda r: (r["record_bytes"], r["clients"], r["op"], r["target"]))
    return rows, ratios


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'size':>5} {'cl':>3} {'op':<6} {'target':<14} {'MB/s':>9} {'pages/s':>10} "
            f"{'p50 ms':>8} {'p99 ms':>8} {'vs raw':>7} {'vs best anchor':>24}")
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = r.get("ratio_to_baseline")
        print(f"{fmt_size(r['record_bytes']):>5} {r['clients']:>3} {r['op']:<6} "
              f"{r['target']:<14} {r['mb_s']:>9.1f} {r['pages_s']:>10.1f} {r['p50_ms']:>8.2f} "
              f"{r['p99_ms']:>8.2f} {'' if ratio is None else f'{ratio:6.2f}x':>7}"
              + (f" {r['ratio_to_best_anchor']:6.2f}x {r['best_anchor']:<16}"
                 if "best_anchor" in r else "")
              + (f"  ERROR {r['error']}" if r["error"] else "")
              + (f"  misses={r['misses']}" if r["misses"] else ""))


def run_throughput(args: argparse.Namespace, targets: list[Any], tmp: Path) -> dict[str, Any]:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    clients = [int(c) for c in args.clients.split(",")]
    results: list[OpResult] = []
    with ExitStack() as stack:
        factories: dict[str, Callable[[], Any]] = {}
        for t in targets:
            print(f"starting {t.name}...", file=sys.stderr)
            factories[t.name] = stack.enter_context(t.start(tmp / t.name))
        for size in sizes:
            batch_pages = max(1, min(128, args.batch_mb * MiB // size))
            for n in clients:
                ws = max(batch_pages, args.working_set_mb * MiB // n // size)
                ws = -(-ws // batch_pages) * batch_pages
                plan = Plan(size, n, batch_pages, ws, args.seconds, args.batches)
                for rep in range(args.repeat):
                    for t in targets:
                        print(f"  {t.name:<14} {fmt_size(size):>4} x{n} rep {rep + 1}",
                              file=sys.stderr)
                        results.extend(run_one(t.name, t.baseline_of, factories[t.name], plan,
                                               rep))
    rows, ratios = summarise(results, {t.name: t.marks for t in targets})
    anchor_ratios = [
        {k: r[k] for k in ("target", "op", "record_bytes", "clients", "mb_s", "best_anchor",
                           "ratio_to_best_anchor")}
        for r in rows if "best_anchor" in r
    ]
    return {"rows": rows, "ratios": ratios, "anchor_ratios": anchor_ratios,
            "validation_mb_s": {fmt_size(s): validation_mb_s(s) for s in sizes}}


def validation_mb_s(record_bytes: int, seconds: float = 0.3) -> float:
    """How fast this machine validates records (hicache_client.backend.verify_record: CRC32 + key
    digest), the work every batch_get adds on top of a backend's raw I/O."""
    from hicache_client.codec import verify_record

    key = _keys(0, 1)
    _block, (rec,) = _records(0, key, record_bytes)
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        verify_record(rec, key[0])
        n += 1
    return n * record_bytes / MiB / (time.perf_counter() - t0)


# Modes of the benchmark. `throughput` is the default.
# NOTE: a `--soak` mode (long mixed run with failures injected) will be added here: write
# `run_soak(args, targets, tmp) -> dict`, register it below, and add its flags in `build_parser`
# under the "soak" argument group; `main` dispatches on `args.mode` and writes whatever dict the
# mode returns under "results".
def run_soak(args: argparse.Namespace, targets: list[Any], tmp: Path) -> dict[str, Any]:
    """`--soak`: N client processes x S seconds of mixed get / set / exists per target, every
    page checked bit for bit, then a full read-back (benchmarks/soak_storage.py)."""
    from benchmarks.soak_storage import run_soak as soak

    return soak(args, targets, tmp)


MODES: dict[str, Callable[[argparse.Namespace, list[Any], Path], dict[str, Any]]] = {
    "throughput": run_throughput,
    "soak": run_soak,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default="",
                   help="comma list of backends (their raw baselines come along); default all")
    p.add_argument("--sizes", default="64K,1M,4M", help="record sizes, e.g. 64K,1M,4M")
    p.add_argument("--clients", default="1,8", help="concurrent client processes, e.g. 1,8")
    p.add_argument("--seconds", type=float, default=2.0, help="time per op per run")
    p.add_argument("--batches", type=int, default=0,
                   help="exactly this many batches per op per client (overrides --seconds)")
    p.add_argument("--batch-mb", type=int, default=8,
                   help="bytes per batch (pages = this / size, 1..128)")
    p.add_argument("--working-set-mb", type=int, default=256,
                   help="records held by all clients of one run together")
    p.add_argument("--repeat", type=int, default=3, help="runs per config; median reported")
    p.add_argument("--quick", action="store_true",
                   help="small and short: 64K,1M; 1,4 clients; 0.3 s; 1 repeat; no diagnostic "
                   "targets unless named")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "bench_storage.json"))
    p.add_argument("--mode", default="throughput", choices=sorted(MODES))
    p.add_argument("--list", action="store_true", help="list the targets and exit")
    p.add_argument("--tmp", default="", help="directory for files and servers (default: a "
                   "fresh temp dir, removed afterwards)")
    p.add_argument("--soak", action="store_true",
                   help="soak mode (same as --mode soak); targets default to hicache,redis")
    from benchmarks.soak_storage import add_soak_arguments

    add_soak_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.soak:
        args.mode = "soak"
    if args.mode == "soak" and not args.targets:
        args.targets = "hicache,redis"
    if args.mode == "soak" and args.out == build_parser().get_default("out"):
        args.out = str(REPO / "benchmarks" / "results" / "bench_storage_soak.json")
    if args.quick:
        args.sizes = "64K,1M" if args.sizes == "64K,1M,4M" else args.sizes
        args.clients = "1,4" if args.clients == "1,8" else args.clients
        args.seconds = min(args.seconds, 0.3)
        args.repeat = 1
        args.working_set_mb = min(args.working_set_mb, 32)
    from benchmarks.storage_targets import discover_targets

    names = [n for n in args.targets.split(",") if n]
    targets = discover_targets(names or None)
    if args.quick:
        targets = [t for t in targets if "diagnostic" not in t.marks or t.name in names]
    if args.list:
        for t in targets:
            print(t.name, f"(baseline of {t.baseline_of})" if t.baseline_of else "", *t.marks)
        return 0
    if not targets:
        print("no targets", file=sys.stderr)
        return 1
    from benchmarks.common import host, save_json, work_dir

    with work_dir(args.tmp, "bench_storage-") as tmp:
        t0 = time.time()
        out = MODES[args.mode](args, targets, tmp)
    report = {"benchmark": "bench_storage", "mode": args.mode, "args": vars(args), "host": host(),
              "started_unix": t0, "seconds": time.time() - t0, "results": out}
    if "rows" in out:
        print_table(out["rows"])
        print("\nrecord validation (verify_record) on this machine: " + ", ".join(
            f"{k}: {v:.0f} MB/s" for k, v in out.get("validation_mb_s", {}).items()))
    if "soak" in out:
        from benchmarks.soak_storage import print_soak

        print_soak(out["soak"])
    save_json(args.out, report, default=lambda o: asdict(o))
    if "soak" in out and not all(r["ok"] for r in out["soak"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
