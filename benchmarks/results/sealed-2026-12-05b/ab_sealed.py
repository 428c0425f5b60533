"""Sealed vs plain `hicache` clients, paired in time: the same client processes alternate
short slices of plain, sealed (and, with --before, sealed with the request sizing before
03e9318) batches, all clients starting each slice at a barrier, in ABBA order; each slice's
sealed / plain ratio is taken against the plain slice next to it, and the median of those
ratios is reported. On a shared 2-core VM whose load moves by 2x within minutes (other
sessions' tests and benchmarks), a ratio of two runs seconds apart holds where one of
bench_storage's (each target measured for 3 s, one after the other) does not.

    PYTHONPATH=. scripts/in_netns.sh .venv/bin/python \\
        benchmarks/results/sealed-2026-12-05b/ab_sealed.py --out /tmp/ab.json

Records of 1 MiB, batches of 8 (bench_storage's), a working set of 64 MiB per client and mode.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
sys.path[:] = [str(REPO)] + [p for p in sys.path if p != str(REPO)]

from benchmarks.bench_storage import _keys, _records  # noqa: E402

MiB = 1 << 20
BATCH = 8
KEY = "5e" * 32
PATHS = {"store": ((), True), "region": (("--shm-store-bytes", "0"), True), "tcp": ((), False)}


def _client(url: str, shm: bool, mode: str) -> Any:
    from benchmarks.storage_targets import bench_config
    from hicache_client.remote.backend import HiCacheServerBackend

    extra: dict[str, Any] = {"url": url, "timeout_ms": 30000, "shm": shm}
    if mode != "plain":
        extra["encryption_key"] = KEY
    b = HiCacheServerBackend(bench_config(extra))
    if mode == "before":  # the request sizing before 03e9318
        b._request_bytes = b.batch_bytes
        b._shm_request_bytes = min(b.batch_bytes, max(1, b.shm_bytes // 8))
    return b


def _worker(url: str, shm: bool, modes: list[str], op: str, slices: int, slice_s: float,
            pages: int, client: int, barrier: Any, queue: Any) -> None:
    try:
        work = {}
        for m, mode in enumerate(modes):
            keys = _keys(100 * client + m, pages)
            blk, vals = _records(client, keys, MiB)
            b = _client(url, shm, mode)
            batches = [(keys[i:i + BATCH], vals[i:i + BATCH]) for i in range(0, pages, BATCH)]
            for ks, vs in batches:  # stored once (gets hit; sets overwrite)
                assert all(b.batch_set(ks, vs))
            work[mode] = (b, batches, blk)
        out_blk = bytearray(BATCH * MiB)
        out = [memoryview(out_blk)[i * MiB:(i + 1) * MiB] for i in range(BATCH)]
        pos = dict.fromkeys(modes, 0)
        for s in range(slices + 1):
            for mode in (modes if s % 2 else modes[::-1]):
                b, batches, _ = work[mode]
                barrier.wait(timeout=300)
                n = 0
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < slice_s:
                    ks, vs = batches[pos[mode] % len(batches)]
                    pos[mode] += 1
                    if op == "set":
                        assert all(b.batch_set(ks, vs))
                    else:
                        assert sum(b.batch_get(ks, out)) == len(ks)
                    n += len(ks)
                queue.put((s, mode, client, n * MiB, t0, time.perf_counter()))
        for b, _, _ in work.values():
            b.close()
        queue.put(None)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put(("error", f"{type(e).__name__}: {e}"))
        barrier.abort()


def measure(url: str, shm: bool, modes: list[str], op: str, clients: int, slices: int,
            slice_s: float, pages: int) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    barrier, queue = ctx.Barrier(clients), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(url, shm, modes, op, slices, slice_s, pages, c,
                                               barrier, queue), daemon=True)
             for c in range(clients)]
    for p in procs:
        p.start()
    rows: dict[tuple[int, str], list[tuple[int, float, float]]] = {}
    done = 0
    while done < clients:
        item = queue.get(timeout=600)
        if item is None:
            done += 1
        elif item[0] == "error":
            raise RuntimeError(item[1])
        else:
            s, mode, _c, nbytes, t0, t1 = item
            rows.setdefault((s, mode), []).append((nbytes, t0, t1))
    for p in procs:
        p.join(timeout=30)
    mb_s: dict[str, list[float]] = {m: [] for m in modes}
    for s in range(1, slices + 1):  # slice 0 warms up
        for mode in modes:
            r = rows[(s, mode)]
            span = max(t1 for _, _, t1 in r) - min(t0 for _, t0, _ in r)
            mb_s[mode].append(sum(n for n, _, _ in r) / span / 1e6)
    res: dict[str, Any] = {"mb_s": {m: statistics.median(v) for m, v in mb_s.items()},
                           "slices_mb_s": mb_s}
    for mode in modes[1:]:
        pairs = [x / p for x, p in zip(mb_s[mode], mb_s["plain"])]
        res[f"{mode}_over_plain"] = statistics.median(pairs)
        res[f"{mode}_over_plain_slices"] = pairs
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default="store,region,tcp")
    ap.add_argument("--ops", default="set,get")
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--slices", type=int, default=10, help="slices per mode (after one warm-up)")
    ap.add_argument("--slice-seconds", type=float, default=0.5)
    ap.add_argument("--pages", type=int, default=64, help="working set per client and mode")
    ap.add_argument("--before", action="store_true", help="also the sizing before 03e9318")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from tests.storage_backends.hicache_server_proc import hicache_server

    modes = ["plain", "sealed"] + (["before"] if args.before else [])
    out: dict[str, Any] = {"benchmark": "ab_sealed", "args": vars(args), "cpus": os.cpu_count(),
                           "loadavg_start": os.getloadavg(), "started_unix": time.time(),
                           "results": []}
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"ab_sealed-{os.getpid()}"
    for path in args.paths.split(","):
        srv_args, shm = PATHS[path]
        with hicache_server(tmp / path, capacity="6GiB",
                            args=["--log-level", "WARNING", *srv_args]) as srv:
            for clients in (int(c) for c in args.clients.split(",")):
                for op in args.ops.split(","):
                    load = os.getloadavg()[0]
                    r = measure(srv.url, shm, modes, op, clients, args.slices,
                                args.slice_seconds, args.pages)
                    r.update(path=path, op=op, clients=clients, loadavg_1m=load)
                    out["results"].append(r)
                    extra = "".join(f"  {m}/plain {r[f'{m}_over_plain']:.2f}" for m in modes[1:])
                    print(f"{path:6} {op} c={clients}  plain {r['mb_s']['plain']:7.0f} MB/s  "
                          f"sealed {r['mb_s']['sealed']:7.0f} MB/s{extra}  (load {load:.1f})",
                          flush=True)
    out["loadavg_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
