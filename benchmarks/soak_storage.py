"""Storage soak: N client processes x S seconds of mixed get / set / exists against each target
(default: `hicache` on a real hicache-server and `redis` on a real redis-server), then a full
read-back.

Each client works on a private key space (and on a key space shared by every client, whose
records are the same whoever writes them), checks every page it reads bit for bit against what
was written, and records the latency of every operation. Afterwards a fresh client reads back
every page that any client stored: each must be present and bit-identical (the servers run
with capacity above the working set, so nothing is evicted). Reports, per target: ops/s,
pages/s, p50/p99 latency per op, errors, mismatches, and pages lost.

    python -m benchmarks.soak_storage --targets hicache,redis --processes 8 --seconds 60
    python benchmarks/bench_storage.py --soak ...   (same flags and rows, in its JSON report)

Exit status 1 when any client saw an error or a wrong page, or a page was lost.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OPS = ("get", "set", "exists")
SHARED_PAGES = 256


def _codec(record_bytes: int) -> Any:
    from benchmarks.storage_targets import BENCH_NAMESPACE
    from hicache_client.codec import HEADER_BYTES, PageCodec

    return PageCodec(namespace=BENCH_NAMESPACE, dtype="uint8",
                     shape=(record_bytes - HEADER_BYTES,), layout="raw", tokens_per_page=32,
                     itemsize=1)


def page_key(space: str, i: int) -> str:
    import hashlib

    return hashlib.sha256(f"soak/{space}/{i}".encode()).hexdigest()


def page_record(codec: Any, space: str, i: int) -> bytes:
    """The one record of page `i` of `space` (every writer of a key writes these bytes)."""
    payload = random.Random(f"{space}/{i}").randbytes(codec.payload_bytes)
    return bytes(codec.encode(page_key(space, i), payload))


def _get(client: Any, keys: list[str], bufs: list[bytearray]) -> list[bool]:
    """Per-key hits: through the backend itself when the client wraps one (a `BackendClient`),
    else by content (a buffer left all zero is a miss)."""
    views = [memoryview(b) for b in bufs]
    backend = getattr(client, "backend", None)
    if backend is not None:
        return list(backend.batch_get(keys, views))
    client.get(keys, views)
    zero = bytes(len(bufs[0])) if bufs else b""
    return [b != zero for b in bufs]


def _client(factory: Callable[[], Any], worker: int, seconds: float, record_bytes: int,
            pages: int, max_batch: int, start_at: float, out_path: str) -> None:
    """One client process: mixed operations until the deadline; JSON summary to `out_path`."""
    res: dict[str, Any] = {"worker": worker, "errors": 0, "mismatches": 0, "error_samples": []}
    lat: dict[str, list[float]] = {op: [] for op in OPS}
    page_counts = {op: 0 for op in OPS}
    stored: set[int] = set()
    shared_stored: set[int] = set()
    try:
        codec = _codec(record_bytes)
        client = factory()
        rng = random.Random(worker)
        mine = f"w{worker}"
        cache: dict[tuple[str, int], bytes] = {}

        def rec(space: str, i: int) -> bytes:
            r = cache.get((space, i))
            if r is None:
                r = cache[(space, i)] = page_record(codec, space, i)
            return r

        while time.time() < start_at:
            time.sleep(0.001)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            x = rng.random()
            shared = rng.random() < 0.2
            space, n = ("shared", SHARED_PAGES) if shared else (mine, pages)
            idx = sorted({rng.randrange(n) for _ in range(rng.randint(1, max_batch))})
            keys = [page_key(space, i) for i in idx]
            t0 = time.perf_counter()
            try:
                if x < 0.35:
                    op = "set"
                    client.put(keys, [memoryview(rec(space, i)) for i in idx])
                    (shared_stored if shared else stored).update(idx)
                elif x < 0.85:
                    op = "get"
                    bufs = [bytearray(record_bytes) for _ in idx]
                    flags = _get(client, keys, bufs)
                    known = shared_stored if shared else stored
                    for i, b, hit in zip(idx, bufs, flags):
                        # A page this client stored must come back; any page that comes back
                        # must be exactly its record.
                        if (hit or i in known) and b != rec(space, i):
                            res["mismatches"] += 1
                else:
                    op = "exists"
                    got = client.exists(keys)
                    known = shared_stored if shared else stored
                    lead = 0
                    while lead < len(idx) and idx[lead] in known:
                        lead += 1
                    if got < lead:
                        res["mismatches"] += 1
            except Exception as e:  # noqa: BLE001 - counted and reported
                res["errors"] += 1
                if len(res["error_samples"]) < 5:
                    res["error_samples"].append(f"{type(e).__name__}: {e}")
                continue
            lat[op].append(time.perf_counter() - t0)
            page_counts[op] += len(idx)
        client.close()
    except Exception:  # noqa: BLE001 - the parent reports it
        res["errors"] += 1
        res["error_samples"].append(traceback.format_exc()[-2000:])
    res["latencies"] = lat
    res["pages"] = page_counts
    res["stored"] = sorted(stored)
    res["shared_stored"] = sorted(shared_stored)
    Path(out_path).write_text(json.dumps(res))


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[k]


def _verify(factory: Callable[[], Any], record_bytes: int,
            results: list[dict[str, Any]]) -> dict[str, int]:
    """Read back every page any client stored; count the missing and the wrong ones."""
    codec = _codec(record_bytes)
    client = factory()
    wanted = [(f"w{r['worker']}", i) for r in results for i in r["stored"]]
    wanted += [("shared", i) for i in sorted({i for r in results for i in r["shared_stored"]})]
    missing = wrong = 0
    try:
        for s in range(0, len(wanted), 64):
            part = wanted[s : s + 64]
            bufs = [bytearray(record_bytes) for _ in part]
            flags = _get(client, [page_key(sp, i) for sp, i in part], bufs)
            for (sp, i), b, hit in zip(part, bufs, flags):
                if not hit:
                    missing += 1
                elif b != page_record(codec, sp, i):
                    wrong += 1
    finally:
        client.close()
    return {"pages_checked": len(wanted), "pages_missing": missing, "pages_wrong": wrong}


def _summarise(name: str, results: list[dict[str, Any]], seconds: float,
               check: dict[str, int]) -> dict[str, Any]:
    row: dict[str, Any] = {"target": name, "clients": len(results), "seconds": seconds}
    total_ops = 0
    for op in OPS:
        values = sorted(v for r in results for v in r["latencies"][op])
        total_ops += len(values)
        row[f"{op}_ops"] = len(values)
        row[f"{op}_pages"] = sum(r["pages"][op] for r in results)
        row[f"{op}_p50_ms"] = _percentile(values, 0.50) * 1e3
        row[f"{op}_p99_ms"] = _percentile(values, 0.99) * 1e3
    all_lat = sorted(v for r in results for op in OPS for v in r["latencies"][op])
    row["ops"] = total_ops
    row["ops_s"] = total_ops / seconds
    row["p99_ms"] = _percentile(all_lat, 0.99) * 1e3
    row["errors"] = sum(r["errors"] for r in results)
    row["mismatches"] = sum(r["mismatches"] for r in results)
    row["error_samples"] = [s for r in results for s in r["error_samples"]][:5]
    row.update(check)
    row["ok"] = (row["errors"] == 0 and row["mismatches"] == 0 and check["pages_missing"] == 0
                 and check["pages_wrong"] == 0)
    return row


def _run_target(name: str, factory: Callable[[], Any], opts: dict[str, Any], tmp: Path,
                start_at: float) -> list[Any]:
    ctx = mp.get_context("fork")
    procs = []
    for w in range(opts["processes"]):
        out = tmp / f"soak-{name}-{w}.json"
        p = ctx.Process(target=_client, args=(factory, w, opts["seconds"], opts["record_bytes"],
                                              opts["pages"], opts["max_batch"], start_at,
                                              str(out)))
        p.start()
        procs.append((p, out))
    return procs


def _options(args: argparse.Namespace) -> dict[str, Any]:
    def get(name: str, default: Any) -> Any:
        v = getattr(args, name, None)
        return default if v is None else v

    return {
        "processes": int(get("soak_processes", 8)),
        "seconds": float(get("soak_seconds", 60.0)),
        "record_bytes": int(get("soak_record_bytes", 16384)),
        "pages": int(get("soak_pages", 2000)),
        "max_batch": int(get("soak_max_batch", 32)),
        "parallel": bool(get("soak_parallel_targets", False)),
    }


def run_soak(args: argparse.Namespace, targets: list[Any], tmp: Path) -> dict[str, Any]:
    """The soak over `targets` (raw baselines are skipped); one row per target."""
    opts = _options(args)
    # Backends only: no raw baselines, no diagnostic variants ("vs:<other>").
    targets = [t for t in targets
               if t.baseline_of is None and not any(m.startswith("vs:") for m in t.marks)]
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        factories = {}
        for t in targets:
            print(f"starting {t.name}...", file=sys.stderr)
            factories[t.name] = stack.enter_context(t.start(tmp / t.name))
        groups = [targets] if opts["parallel"] else [[t] for t in targets]
        for group in groups:
            start_at = time.time() + 1.0
            running = {t.name: _run_target(t.name, factories[t.name], opts, tmp, start_at)
                       for t in group}
            print(f"soak: {', '.join(running)} x{opts['processes']} for {opts['seconds']}s",
                  file=sys.stderr)
            for name, procs in running.items():
                results = []
                for p, out in procs:
                    p.join(opts["seconds"] + 300)
                    if p.is_alive():
                        p.kill()
                        p.join()
                    if out.exists():
                        results.append(json.loads(out.read_text()))
                    else:
                        results.append({"worker": -1, "errors": 1, "mismatches": 0,
                                        "error_samples": [f"client exited {p.exitcode}"],
                                        "latencies": {op: [] for op in OPS},
                                        "pages": {op: 0 for op in OPS}, "stored": [],
                                        "shared_stored": []})
                check = _verify(factories[name], opts["record_bytes"], results)
                rows.append(_summarise(name, results, opts["seconds"], check))
    return {"soak": rows, "options": opts}


def print_soak(rows: list[dict[str, Any]]) -> None:
    head = (f"{'target':<10} {'cl':>3} {'ops/s':>9} {'p99 ms':>8} {'get p99':>8} "
            f"{'set p99':>8} {'ex p99':>8} {'errors':>6} {'wrong':>6} {'lost':>5} {'checked':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['target']:<10} {r['clients']:>3} {r['ops_s']:>9.1f} {r['p99_ms']:>8.2f} "
              f"{r['get_p99_ms']:>8.2f} {r['set_p99_ms']:>8.2f} {r['exists_p99_ms']:>8.2f} "
              f"{r['errors']:>6} {r['mismatches'] + r['pages_wrong']:>6} "
              f"{r['pages_missing']:>5} {r['pages_checked']:>8}")
        for s in r["error_samples"]:
            print(f"    error: {s}")


def add_soak_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("soak")
    g.add_argument("--soak-processes", type=int, default=8, help="client processes per target")
    g.add_argument("--soak-seconds", type=float, default=60.0, help="length of the mixed run")
    g.add_argument("--soak-record-bytes", type=int, default=16384, help="bytes per page record")
    g.add_argument("--soak-pages", type=int, default=2000, help="private pages per client")
    g.add_argument("--soak-max-batch", type=int, default=32, help="most pages in one operation")
    g.add_argument("--soak-parallel-targets", action="store_true",
                   help="soak every target at the same time (default: one after another)")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="hicache,redis", help="comma list of storage targets")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "soak_storage.json"))
    p.add_argument("--tmp", default="", help="directory for servers (default: a temp dir)")
    add_soak_arguments(p)
    args = p.parse_args(argv)
    from benchmarks.storage_targets import discover_targets

    names = [n for n in args.targets.split(",") if n]
    targets = [t for t in discover_targets(names) if t.name in names]
    from benchmarks.common import save_json, work_dir

    with work_dir(args.tmp, "soak-") as tmp:
        t0 = time.time()
        out = run_soak(args, targets, tmp)
    print_soak(out["soak"])
    report = {"benchmark": "soak_storage", "args": vars(args), "cpus": os.cpu_count(),
              "started_unix": t0, "seconds": time.time() - t0, "results": out}
    save_json(args.out, report)
    return 0 if all(r["ok"] for r in out["soak"]) else 1


if __name__ == "__main__":
    sys.exit(main())
