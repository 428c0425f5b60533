"""`hicache-hitrate` at 10M requests (issue 35's targets): the default report and `--sample`.

The trace: traces/mooncake_conversation_trace.jsonl repeated `--scale` times (832: 10,009,792
requests, 242 M page references at block 512) with disjoint hash ids, interleaved in time, built
by `bench_hitrate_peers.build_trace` (about 3.3 GB for x832; written under `--dir`, kept for the
next run). Three runs of the CLI, one at a time, each a child process (wall time; peak RSS from
`wait4`), nice'd:

1. `default`: `hicache-hitrate TRACE --mrc --mrc-points 15 --json` (the replay of the default
   configuration, an unbounded device, which `--replay-engine auto` runs compiled at this size;
   the unbounded bound; OPT, the bound at an unbounded size; the exact curve; reuse distances;
   sharing). Target: at most 15 minutes and 6 GiB.
2. `sample`: `hicache-hitrate TRACE --sample RATE --mrc-points 15 --json`. Target at 0.01: at
   most 2 minutes and 2 GiB, within 0.01 of the exact curve at every printed point.

Each run records its wall time, its CPU time (user + system) and the 1-minute load average
before and after: on a machine shared with others the wall time includes waiting for a core.
3. `exact_at_sample_points` (not a target run): the exact one-pass curve of the whole trace at
   the capacities the sampled run printed, for its true error.

`--before REV` also times run 1, and `--mrc --sample RATE` (which then ran the exact pass and the
sampled one), with the code at REV (`git archive REV tools`; its imports of
`hicache.errors` / `hicache.units` pointed at `hicache_client`); at 10M it needs far more than
this machine's memory (its replay holds a Python node per cached path), so use it with a smaller
`--scale`.

    python benchmarks/bench_hitrate_scale.py [--scale 832] [--rate 0.01] [--before REV]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_hitrate_peers import TRACE, build_trace, run_child  # noqa: E402
from benchmarks.common import host, save_json  # noqa: E402

CLI = ["-c", "import sys; from tools.hitrate.cli import main; sys.exit(main(sys.argv[1:]))"]


def exact_at(trace: str, caps: list[int]) -> dict[str, Any]:
    """Child: the exact one-pass curve of the whole trace at `caps` (token hit rates)."""
    from tools.hitrate import fast
    from tools.hitrate.arrays import BlockSink
    from tools.hitrate.traces import read_trace

    sink = BlockSink()
    arrs = sink.arrays(read_trace(trace, block_size=512, sink=sink), 512)
    del sink
    st = fast.stack_distances(arrs)
    return {"capacities": caps, "hit_rates": [st.hit_tokens(c) / st.input_tokens for c in caps]}


def cli_run(trace: Path, args: list[str], out: Path, root: Path = REPO) -> dict[str, Any]:
    """The CLI on `trace` in a child (nice 10) run from `root`; its time, RSS and document."""
    cmd = ["nice", "-n", "10", sys.executable, *CLI, str(trace), *args, "--json", "--no-progress"]
    env_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = f"{root}:{REPO}"  # `python -c` puts its working folder first
    load = os.getloadavg()[0]  # others' work on the shared machine shows in the wall time
    try:
        run = run_child(cmd, out, cwd=root)
    finally:
        if env_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env_path
    return {**run, "load_avg_1m": [load, os.getloadavg()[0]], "command": ["hicache-hitrate", str(trace), *args, "--json", "--no-progress"],
            "doc": json.loads(out.read_text())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=832, help="repetitions of the Mooncake trace")
    ap.add_argument("--rate", type=float, default=0.01, help="--sample rate")
    ap.add_argument("--dir", default="/tmp", help="where the built trace is written and kept")
    ap.add_argument("--before", metavar="REV", help="also run the default report at REV")
    ap.add_argument("--skip-default", action="store_true", help="only the sampled runs")
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/bench_hitrate_scale.json"))
    ap.add_argument("--child-exact", nargs=2, metavar=("TRACE", "CAPS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_exact:
        t, caps = args.child_exact
        print(json.dumps(exact_at(t, [int(c) for c in caps.split(",")])))
        return 0
    trace = Path(args.dir) / f"mooncake_x{args.scale}.jsonl"
    if not trace.exists():
        tmp = trace.with_suffix(".part")
        n = build_trace(TRACE, args.scale, tmp)
        tmp.rename(trace)
        print(f"built {trace}: {n:,} requests", file=sys.stderr)
    report: dict[str, Any] = {"benchmark": "hitrate_scale", "machine": host(),
                              "scale": args.scale, "trace_bytes": trace.stat().st_size,
                              "runs": {}}
    runs = report["runs"]
    with tempfile.TemporaryDirectory(prefix="hitrate-scale-") as tmpdir:
        d = Path(tmpdir)
        if not args.skip_default:
            runs["default"] = cli_run(trace, ["--mrc", "--mrc-points", "15"], d / "default.json")
            print(json.dumps({"default_s": runs["default"]["seconds"],
                              "default_rss": runs["default"]["peak_rss_bytes"]}), flush=True)
        runs["sample"] = cli_run(trace, ["--sample", str(args.rate), "--mrc-points", "15"],
                                 d / "sample.json")
        print(json.dumps({"sample_s": runs["sample"]["seconds"],
                          "sample_rss": runs["sample"]["peak_rss_bytes"]}), flush=True)
        pts = runs["sample"]["doc"]["mrc"]["points"]
        caps = [p["capacity_pages"] for p in pts]
        ex_out = d / "exact.json"
        ex_run = run_child(["nice", "-n", "10", sys.executable, __file__, "--child-exact",
                            str(trace), ",".join(map(str, caps))], ex_out)
        ex = json.loads(ex_out.read_text())
        errs = [abs(p["hit_rate"] - e) for p, e in zip(pts, ex["hit_rates"])]
        runs["exact_at_sample_points"] = {**ex_run, **ex}
        report["sample_error"] = {
            "max_abs_error": max(errs), "mean_abs_error": sum(errs) / len(errs),
            "points": [{"capacity_pages": c, "sampled": p["hit_rate"], "exact": e}
                       for c, p, e in zip(caps, pts, ex["hit_rates"])],
            "printed_check": runs["sample"]["doc"]["mrc"]["sample"]["check"],
        }
        if args.before:
            old = d / "old"
            old.mkdir()
            subprocess.run(f"git archive {args.before} tools | tar -x -C {old}", shell=True,
                           check=True, cwd=REPO)
            for f in old.rglob("*.py"):  # the client modules moved to hicache_client
                s = f.read_text()
                f.write_text(s.replace("from hicache.errors", "from hicache_client.errors")
                             .replace("from hicache import units", "from hicache_client import units"))
            runs["default_before"] = cli_run(trace, ["--mrc", "--mrc-points", "15"],
                                             d / "before.json", root=old)
            # before, --sample went with --mrc and ran the exact pass beside the sampled one
            runs["sample_before"] = cli_run(trace, ["--mrc", "--mrc-points", "15", "--sample",
                                                    str(args.rate)], d / "before_s.json",
                                            root=old)
    for r in runs.values():  # the documents stay, minus the bulky per-point lists of the curve
        doc = r.get("doc")
        if doc and doc.get("reuse_distance"):
            doc["reuse_distance"]["buckets"] = len(doc["reuse_distance"]["buckets"])
    targets = {}
    for name, secs, rss in (("default", 900, 6 << 30), ("sample", 120, 2 << 30)):
        if name not in runs:
            continue
        r = runs[name]
        ok = r["peak_rss_bytes"] <= rss and (
            name != "sample" or report["sample_error"]["max_abs_error"] <= 0.01)
        targets[name] = {"seconds_max": secs, "rss_max_bytes": rss,
                         "met_wall": ok and r["seconds"] <= secs,
                         "met_cpu": ok and r["cpu_seconds"] <= secs}
    report["targets"] = targets
    save_json(args.out, report)
    print(json.dumps(targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
