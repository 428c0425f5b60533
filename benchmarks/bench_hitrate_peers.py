"""`hicache-hitrate` against `kvcache-simulator` (PyPI 0.1.3, its C++ backend) on the peer's
question: the token hit rate at its default budgets (1 GiB .. 16 TiB of KV for `--model`) under
LRU and the optimum, over the last half of the requests (warm-up 0.5, the peer's default).

Traces: traces/mooncake_conversation_trace.jsonl repeated `--scales` times with disjoint hash
ids, interleaved in time (copy k of a request keeps its timestamp; ties in copy order). Each tool
runs in its own child process, once per trace; time is wall time and memory the child's peak RSS
(`wait4`). Ours answers with the streamed reader and the compiled analyses
(`tools/hitrate/fast.py`): HiRadixCache's own LRU (`tree_lru`, exact) and Belady, one pass per
budget each (on threads), and the one-pass LRU curve beside them. `--before` also times the command of issue 35's table with the code before those
(`git archive <rev> tools`). `--verify N` replays N budgets of the x1 trace exactly through
`HiRadixCache` and compares them with the compiled LRU.

`libcachesim` (PyPI 0.3.5, libCacheSim's C core; the `bench` extra) answers only where it
applies: a plain LRU of pages, each page reference of the trace in order (every request's path,
root first, lookup and inserted pages) a get of one object of size 1, at the same budgets in
pages, one simulation per budget. It has no prefix semantics (a page hit after a miss counts;
a token hit rate needs the leading run), no output insertion order of a tree, no warm-up, so it
is compared with ours on that question: our page-level LRU from one stack pass over the same
sequence (`page_lru`), hit for hit. Its trace is written as an oracleGeneral binary file by a
child that is not timed.

    python benchmarks/bench_hitrate_peers.py [--scales 10,30] [--before 5e30887] [--verify 2]

`--default-command` times instead what a new user runs first (issue 49): `hicache-hitrate TRACE
--device Np --mrc --mrc-points 15 --json` (N: `--device-pages`), cold (its own empty
NUMBA_CACHE_DIR: every compiled function compiled in that run, as on the first run after
`pip install`) then warm (the same folder, filled), beside `kvcache-simulator run --trace TRACE
--model M --block-size 512 --format json` (scales up to `--peer-max-scale`) and libCacheSim's
LRU at our 15 curve capacities (hits compared with our curve's page LRU), wall, CPU, peak RSS
and the load average before each run:

    python benchmarks/bench_hitrate_peers.py --default-command --scales 1,30,300 --dir /tmp
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import host, save_json  # noqa: E402

TRACE = REPO / "traces" / "mooncake_conversation_trace.jsonl"
BLOCK = 512


def build_trace(src: Path, scale: int, out: Path) -> int:
    """`scale` copies of `src` with disjoint hash ids, merged in timestamp order."""
    rows = [json.loads(line) for line in src.open() if line.strip()]
    span = 1 + max(h for r in rows for h in r["hash_ids"])
    n = 0
    with out.open("w") as f:
        for r in rows:  # the source is in timestamp order: copies of one row are adjacent
            for k in range(scale):
                f.write(json.dumps({**r, "hash_ids": [h + k * span for h in r["hash_ids"]]})
                        + "\n")
                n += 1
    return n


def run_child(cmd: list[str], stdout: Path | None = None, cwd: Path = REPO) -> dict[str, Any]:
    """Runs `cmd` in `cwd`; its wall time, CPU time (user + system: on a shared machine the
    wall time includes waiting for a core) and peak RSS (bytes)."""
    t0 = time.perf_counter()
    with open(stdout or os.devnull, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, cwd=cwd)
        _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode() if proc.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cmd[:3]} failed: {err[-2000:]}")
    return {"seconds": wall, "cpu_seconds": ru.ru_utime + ru.ru_stime,
            "peak_rss_bytes": ru.ru_maxrss * 1024}


def ours(trace: str, caps: list[int], warmup: float, verify: int) -> dict[str, Any]:
    """The child process of our side: prints its answer as JSON."""
    from tools.hitrate import fast, fast_replay
    from tools.hitrate.arrays import BlockSink
    from tools.hitrate.traces import read_trace

    t0 = time.perf_counter()
    sink = BlockSink()
    tr = read_trace(trace, block_size=BLOCK, sink=sink)
    arrs = sink.arrays(tr, BLOCK)
    del sink
    t_read = time.perf_counter() - t0
    t1 = time.perf_counter()
    stack = fast.stack_distances(arrs, warmup=warmup)  # the one-pass curve (an upper bound)
    t_mrc = time.perf_counter() - t1
    t1 = time.perf_counter()
    lru = fast_replay.tree_lru(arrs, caps, warmup=warmup)  # HiRadixCache's own LRU, exact
    t_lru = time.perf_counter() - t1
    t1 = time.perf_counter()
    opts = fast_replay.belady(arrs, caps, warmup=warmup)
    t_opt = time.perf_counter() - t1
    n_in = stack.input_tokens
    doc: dict[str, Any] = {
        "read_s": t_read, "lru_s": t_lru, "opt_s": t_opt, "mrc_s": t_mrc,
        "requests": arrs.requests, "page_refs": len(arrs.pages), "array_bytes": arrs.nbytes(),
        "points": [{"cacheBlocks": c, "lru": x.hit_tokens / n_in, "optimal": o.hit_tokens / n_in,
                    "lru_one_pass_curve": stack.hit_tokens(c) / n_in}
                   for c, x, o in zip(caps, lru, opts)],
        "ceiling": stack.unbounded_hit_tokens / n_in,
    }
    if verify:
        from tools.hitrate.simulate import TierConfig, replay_arrays  # imports torch: 200 MB

        # Exact replays (device-only LRU through HiRadixCache) at `verify` budgets spread over
        # the list, counted over the whole trace, next to the compiled LRU's number.
        picks = caps[:: max(1, len(caps) // verify)][:verify]
        checks = []
        for c, x in zip(picks, fast_replay.tree_lru(arrs, picks)):
            t1 = time.perf_counter()
            sim = replay_arrays(arrs, TierConfig(page_size=BLOCK, device_pages=c))
            checks.append({"cacheBlocks": c, "exact_replay_hit_tokens": sim.hit_tokens,
                           "compiled_lru_hit_tokens": x.hit_tokens,
                           "equal": sim.hit_tokens == x.hit_tokens,
                           "replay_s": time.perf_counter() - t1})
        doc["exact_replay"] = checks
    return doc


def page_lru(arrs: Any, caps: list[int]) -> list[int]:
    """Hits of a plain LRU of `cap` pages over the trace's page references in order (each
    request's path, lookup and inserted pages, root first), one stack pass for every budget:
    the arrays cut to one page per request, so the tree's batching does not apply."""
    import numpy as np

    from tools.hitrate import fast
    from tools.hitrate.arrays import PageArrays

    n = len(arrs.pages)
    one = PageArrays(arrs.pages, np.arange(n + 1, dtype=np.int64), np.ones(n, np.int64),
                     np.full(n, arrs.page_size, np.int64), np.zeros(n, np.int64),
                     arrs.page_size, arrs.num_pages)
    cum = np.cumsum(fast.stack_distances(one).reuse_at)
    return [int(cum[min(c, len(cum) - 1)]) for c in caps]


def page_lru_child(trace: str, caps: list[int]) -> dict[str, Any]:
    """Child: our side of libcachesim's question (`page_lru`), read included."""
    from tools.hitrate.arrays import BlockSink
    from tools.hitrate.traces import read_trace

    t0 = time.perf_counter()
    sink = BlockSink()
    arrs = sink.arrays(read_trace(trace, block_size=BLOCK, sink=sink), BLOCK)
    del sink
    t1 = time.perf_counter()
    hits = page_lru(arrs, caps)
    return {"read_s": t1 - t0, "lru_s": time.perf_counter() - t1, "hits": hits,
            "page_refs": len(arrs.pages)}


def write_oracle(trace: str, out: str) -> int:
    """The trace's page references (as `page_lru` takes them) as a libCacheSim oracleGeneral
    binary trace (uint32 time, uint64 id, uint32 size, int64 next access: -1), size 1 each."""
    import numpy as np

    from tools.hitrate.arrays import BlockSink
    from tools.hitrate.traces import read_trace

    sink = BlockSink()
    arrs = sink.arrays(read_trace(trace, block_size=BLOCK, sink=sink), BLOCK)
    n = len(arrs.pages)
    rec = np.zeros(n, dtype=[("t", "<u4"), ("id", "<u8"), ("sz", "<u4"), ("nxt", "<i8")])
    rec["t"] = np.arange(n)
    rec["id"] = arrs.pages.astype(np.uint64) + 1
    rec["sz"] = 1
    rec["nxt"] = -1
    rec.tofile(out)
    return n


def libcachesim_lru(path: str, caps: list[int]) -> dict[str, Any]:
    """Child: libCacheSim's LRU (its C core) at each budget in pages over an oracleGeneral
    trace, one simulation per budget; hits and seconds."""
    import libcachesim as lcs

    out = []
    t0 = time.perf_counter()
    for c in caps:
        reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
        t1 = time.perf_counter()
        miss, _ = lcs.LRU(c).process_trace(reader)
        out.append({"cacheBlocks": c, "miss_ratio": miss, "seconds": time.perf_counter() - t1})
    return {"points": out, "seconds": time.perf_counter() - t0}


def sample_errors(trace: str) -> list[dict[str, Any]]:
    """`--sample`'s curve against the exact one at a 15-point MRC (whole trace)."""
    from tools.hitrate import fast, mrc
    from tools.hitrate.arrays import BlockSink
    from tools.hitrate.traces import read_trace

    sink = BlockSink()
    arrs = sink.arrays(read_trace(trace, block_size=BLOCK, sink=sink), BLOCK)
    t1 = time.perf_counter()
    whole = fast.stack_distances(arrs)
    t_exact = time.perf_counter() - t1
    pts = mrc.mrc_points(whole, 15)
    out = []
    for rate in (0.1, 0.01):
        t1 = time.perf_counter()
        samp = fast.sampled_stack(arrs, rate)
        t_s = time.perf_counter() - t1
        errs = [abs(samp.hit_tokens(c) - whole.hit_tokens(c)) / whole.input_tokens for c in pts]
        out.append({"rate": rate, "seconds": t_s, "exact_seconds": t_exact,
                    "max_abs_error": max(errs), "sampled_page_refs": samp.sampled_refs,
                    "page_refs": len(arrs.pages)})
    return out


def default_command(args: argparse.Namespace, peer: str) -> dict[str, Any]:
    """`--default-command`: the report (see the module's doc)."""
    report: dict[str, Any] = {"benchmark": "hitrate_peers_default_command", "machine": host(),
                              "model": args.model, "device_pages": args.device_pages,
                              "runs": []}
    cli = [sys.executable, "-m", "tools.hitrate.cli"]
    for scale in [int(x) for x in args.scales.split(",")]:
        trace = TRACE
        if scale > 1:
            trace = Path(args.dir) / f"mooncake_x{scale}.jsonl"
            if not trace.exists():
                build_trace(TRACE, scale, trace.with_suffix(".part"))
                trace.with_suffix(".part").rename(trace)
        run: dict[str, Any] = {"scale": scale, "trace": str(trace)}
        with tempfile.TemporaryDirectory(prefix="hitrate-numba-") as cache:
            os.environ["NUMBA_CACHE_DIR"] = cache
            out = Path(cache) / "ours.json"
            for label in ("cold", "warm"):
                load = os.getloadavg()
                r = run_child([*cli, str(trace), "--device", f"{args.device_pages}p", "--mrc",
                               "--mrc-points", "15", "--json", "--no-progress"], out)
                doc = json.loads(out.read_text())
                run[f"ours_{label}"] = {**r, "load_avg": load, "timing": doc["timing"],
                                        "replay_engine": doc["config"]["replay_engine"],
                                        "hit_rate": doc["result"]["hit_rate"]}
            os.environ.pop("NUMBA_CACHE_DIR")
        caps = [pt["capacity_pages"] for pt in doc["mrc"]["points"]]
        if scale <= args.peer_max_scale:
            peer_out = Path(args.dir) / "peer.json"
            load = os.getloadavg()
            r = run_child([peer, "run", "--trace", str(trace), "--model", args.model,
                           "--block-size", str(BLOCK), "--format", "json", "--no-progress",
                           "--output", str(peer_out)])
            run["peer"] = {**r, "load_avg": load}
            peer_out.unlink()
            for label in ("cold", "warm"):
                o = run[f"ours_{label}"]
                run[f"{label}_time_ratio"] = o["seconds"] / r["seconds"]
                run[f"{label}_cpu_ratio"] = o["cpu_seconds"] / r["cpu_seconds"]
                run[f"{label}_rss_ratio"] = o["peak_rss_bytes"] / r["peak_rss_bytes"]
        try:
            import libcachesim  # noqa: F401
        except ImportError:
            run["libcachesim_lru"] = {"skipped": "libcachesim is not installed"}
        else:
            oracle = Path(args.dir) / "pages.oracleGeneral"
            tmp_out = Path(args.dir) / "lcs.json"
            run_child([sys.executable, __file__, "--child-oracle", str(trace), str(oracle)],
                      tmp_out)
            load = os.getloadavg()
            lr = run_child([sys.executable, __file__, "--child-lcs", str(oracle),
                            ",".join(map(str, caps))], tmp_out)
            ldoc = json.loads(tmp_out.read_text())
            pl = run_child([sys.executable, __file__, "--child-page-lru", str(trace),
                            ",".join(map(str, caps))], tmp_out)
            mine = json.loads(tmp_out.read_text())
            oracle.unlink()
            tmp_out.unlink()
            refs = mine["page_refs"]
            run["libcachesim_lru"] = {
                **lr, "load_avg": load, "page_refs": refs, "ours_page_lru": pl,
                "hits_equal": all(round((1 - p["miss_ratio"]) * refs) == h
                                  for p, h in zip(ldoc["points"], mine["hits"]))}
        report["runs"].append(run)
        print(json.dumps({k: v for k, v in run.items() if k.endswith("ratio")}
                         | {"scale": scale, "cold_s": run["ours_cold"]["seconds"],
                            "warm_s": run["ours_warm"]["seconds"],
                            "peer_s": run.get("peer", {}).get("seconds")}), flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", default="10,30", help="trace repetitions, comma-separated")
    ap.add_argument("--model", default="llama-3.1-8b", help="a kvcache-simulator model id")
    ap.add_argument("--before", metavar="REV", help="also time the pre-change CLI at REV")
    ap.add_argument("--verify", type=int, default=0, metavar="N",
                    help="exact HiRadixCache replays at the N smallest budgets (x1 trace)")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/bench_hitrate_peers.json"))
    ap.add_argument("--default-command", action="store_true",
                    help="time the CLI's default command cold and warm (see the module's doc)")
    ap.add_argument("--device-pages", type=int, default=16384, help="--default-command's N")
    ap.add_argument("--peer-max-scale", type=int, default=30,
                    help="--default-command: run kvcache-simulator up to this scale")
    ap.add_argument("--dir", default="/tmp", help="--default-command: where traces are kept")
    ap.add_argument("--child", nargs=4, metavar=("TRACE", "CAPS", "WARMUP", "VERIFY"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--child-sample", metavar="TRACE", help=argparse.SUPPRESS)
    ap.add_argument("--child-oracle", nargs=2, metavar=("TRACE", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--child-lcs", nargs=2, metavar=("ORACLE", "CAPS"), help=argparse.SUPPRESS)
    ap.add_argument("--child-page-lru", nargs=2, metavar=("TRACE", "CAPS"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_page_lru:
        t, caps = args.child_page_lru
        print(json.dumps(page_lru_child(t, [int(c) for c in caps.split(",")])))
        return 0
    if args.child_oracle:
        print(json.dumps({"page_refs": write_oracle(*args.child_oracle)}))
        return 0
    if args.child_lcs:
        path, caps = args.child_lcs
        print(json.dumps(libcachesim_lru(path, [int(c) for c in caps.split(",")])))
        return 0
    if args.child_sample:
        print(json.dumps(sample_errors(args.child_sample)))
        return 0
    if args.child:
        t, caps, w, v = args.child
        print(json.dumps(ours(t, [int(c) for c in caps.split(",")], float(w), int(v))))
        return 0
    peer = shutil.which("kvcache-simulator", path=str(Path(sys.executable).parent))
    if peer is None:
        print("kvcache-simulator is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return 2
    if args.default_command:
        save_json(args.out, default_command(args, peer))
        return 0
    report: dict[str, Any] = {"benchmark": "hitrate_peers", "machine": host(),
                              "model": args.model, "block": BLOCK, "runs": []}
    with tempfile.TemporaryDirectory(prefix="hitrate-peers-") as tmp:
        d = Path(tmp)
        old = None
        if args.before:
            old = d / "old"
            old.mkdir()
            subprocess.run(f"git archive {args.before} tools | tar -x -C {old}", shell=True,
                           check=True, cwd=REPO)
        for scale in [int(s) for s in args.scales.split(",")]:
            trace = d / f"mooncake_x{scale}.jsonl"
            n = build_trace(TRACE, scale, trace) if scale > 1 else None
            if scale == 1:
                trace = TRACE
            peer_out = d / "peer.json"
            p_run = run_child([peer, "run", "--trace", str(trace), "--model", args.model,
                               "--block-size", str(BLOCK), "--format", "json", "--no-progress",
                               "--output", str(peer_out)])
            pdoc = json.loads(peer_out.read_text())
            caps = [pt["cacheBlocks"] for pt in pdoc["points"]]
            our_out = d / "ours.json"
            o_run = run_child([sys.executable, __file__, "--child", str(trace),
                               ",".join(map(str, caps)), "0.5",
                               str(args.verify if scale == 1 else 0)], our_out)
            odoc = json.loads(our_out.read_text())
            run_child([sys.executable, __file__, "--child-sample", str(trace)], our_out)
            sample = json.loads(our_out.read_text())
            lcs_doc: dict[str, Any] | None = None
            try:
                import libcachesim  # noqa: F401
            except ImportError:
                lcs_doc = {"skipped": "libcachesim is not installed (pip install -e '.[bench]')"}
            if lcs_doc is None:
                oracle = d / "pages.oracleGeneral"
                run_child([sys.executable, __file__, "--child-oracle", str(trace), str(oracle)],
                          our_out)
                l_run = run_child([sys.executable, __file__, "--child-lcs", str(oracle),
                                   ",".join(map(str, caps))], our_out)
                oracle.unlink()
                ldoc = json.loads(our_out.read_text())
                pl_run = run_child([sys.executable, __file__, "--child-page-lru", str(trace),
                                   ",".join(map(str, caps))], our_out)
                pdoc_ours = json.loads(our_out.read_text())
                refs = pdoc_ours["page_refs"]
                lcs_doc = {**l_run, "page_refs": refs,
                           "ours": {**pl_run, **{k: v for k, v in pdoc_ours.items()
                                                if k != "hits"}},
                           "points": [
                    {**pt, "hits": round((1 - pt["miss_ratio"]) * refs), "ours_hits": h,
                     "equal": round((1 - pt["miss_ratio"]) * refs) == h}
                    for pt, h in zip(ldoc["points"], pdoc_ours["hits"])]}
            run: dict[str, Any] = {
                "scale": scale, "requests": n or odoc["requests"],
                "page_refs": odoc["page_refs"],
                "peer": {**p_run, "ceiling": pdoc["hitRateCeiling"],
                         "points": [{"cacheBlocks": pt["cacheBlocks"], "gib": pt["gib"],
                                     "lru": pt["results"]["lru"]["hitRate"],
                                     "optimal": pt["results"]["optimal"]["hitRate"]}
                                    for pt in pdoc["points"]]},
                "ours": {**o_run, **odoc},
                "sample": sample,
                "libcachesim_lru": lcs_doc,
                "speedup": p_run["seconds"] / o_run["seconds"],
                "rss_ratio": o_run["peak_rss_bytes"] / p_run["peak_rss_bytes"],
            }
            if old is not None:
                cmd = [sys.executable, "-c", "import sys; from tools.hitrate.cli import main; "
                       "sys.exit(main(sys.argv[1:]))", str(trace), "--device",
                       f"{caps[len(caps) // 2]}p", "--mrc", "--mrc-points", "15", "--json",
                       "--no-progress"]
                for label, root in (("before", old), ("after", REPO)):
                    # `python -c` puts its working folder first on sys.path: run in `root`
                    os.environ["PYTHONPATH"] = f"{root}:{REPO}"
                    run[f"cli_{label}"] = run_child(cmd, cwd=root)
                os.environ.pop("PYTHONPATH", None)
                run["cli_speedup"] = run["cli_before"]["seconds"] / run["cli_after"]["seconds"]
                run["cli_rss_ratio"] = (run["cli_after"]["peak_rss_bytes"]
                                        / run["cli_before"]["peak_rss_bytes"])
            report["runs"].append(run)
            print(json.dumps({k: run[k] for k in ("scale", "requests", "speedup", "rss_ratio")}
                             | {"ours_s": o_run["seconds"], "peer_s": p_run["seconds"],
                                "ours_rss": o_run["peak_rss_bytes"],
                                "peer_rss": p_run["peak_rss_bytes"]}), flush=True)
    save_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
