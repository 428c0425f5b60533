"""`make bench`: run every benchmark in benchmarks/ at a size that finishes in minutes, collect
their JSON from benchmarks/results/ and write benchmarks/results/summary.md.

Each `benchmarks/bench_*.py` runs as its own subprocess with `--quick` (when it has the flag;
its JSON then goes to `results/NAME_quick.json`) and a time limit. A benchmark that fails or times out is reported and skipped; the exit status is 1
when any failed. The summary shows each benchmark's key numbers and ratios (ratios, not absolute
times, are what compares across machines).

    python benchmarks/run_all.py [--only bench_radix,bench_storage] [--timeout 1200] [--full]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "benchmarks"
RESULTS = BENCH_DIR / "results"


def discover() -> list[Path]:
    return sorted(BENCH_DIR.glob("bench_*.py"))


def has_flag(script: Path, flag: str) -> bool:
    return f'"{flag}"' in script.read_text(errors="replace")


def new_json(since: float) -> list[Path]:
    return sorted(
        (p for p in RESULTS.glob("*.json") if p.stat().st_mtime >= since),
        key=lambda p: p.stat().st_mtime,
    )


def fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3g}"
        return f"{v:.3f}".rstrip("0").rstrip(".") if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return out


# ---- per-benchmark summaries (a generic one for the rest) ------------------------------------


def sum_multiturn(d: dict[str, Any]) -> list[str]:
    res = d.get("results", {})
    rows = [[name, r.get("ttft_p50_s"), r.get("ttft_p90_s"), r.get("throughput_tok_s"),
             r.get("hit_rate"), *(r.get("hit_tokens", {}).get(t) for t in
                                  ("device", "host", "storage"))]
            for name, r in res.items()]
    out = table(["config", "TTFT p50 s", "TTFT p90 s", "tok/s", "hit rate", "L1 hit tok",
                 "L2 hit tok", "L3 hit tok"], rows)
    targets = d.get("targets") or {}
    if targets:
        out += ["", *table(["target ratio", "target", "measured", "met"],
                           [[k, v.get("target"), v.get("measured"), v.get("met")]
                            for k, v in targets.items()])]
    return out


def sum_storage(d: dict[str, Any]) -> list[str]:
    res = d.get("results", {})
    rows = [[r.get("target"), r.get("op"), r.get("record_bytes"), r.get("clients"),
             r.get("mb_s"), r.get("p99_ms"), r.get("ratio_to_baseline")]
            for r in res.get("rows", []) if not r.get("error")]
    return table(["target", "op", "record bytes", "clients", "MB/s", "p99 ms",
                  "ratio to baseline"], rows)


def sum_radix(d: dict[str, Any]) -> list[str]:
    rows = [[r.get("page_size"), r.get("match_pages_per_s"), r.get("acquire_insert_pages_per_s"),
             r.get("requests_per_s"), r.get("hit_rate")] for r in d.get("results", [])]
    return table(["page size", "match pages/s", "acquire+insert pages/s", "requests/s",
                  "hit rate"], rows)


def _flatten(d: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _flatten(v, f"{prefix}{k}.")
    elif isinstance(d, (int, float)):
        yield prefix[:-1], d


def sum_generic(d: dict[str, Any]) -> list[str]:
    """Ratios and rates first, then other top-level numbers (at most 30 lines)."""
    pairs = [(k, v) for k, v in _flatten(d) if isinstance(v, (int, float))]
    key = [p for p in pairs if any(w in p[0] for w in ("ratio", "_vs_", "per_s", "hit_rate",
                                                       "speed", "met"))]
    rest = [p for p in pairs if p not in key and p[0].count(".") <= 1]
    return table(["metric", "value"], [[k, v] for k, v in (key + rest)[:30]])


SUMMARIES: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "bench_multiturn": sum_multiturn,
    "bench_multi_instance": sum_multiturn,  # same shape: per-config TTFT, hit rate, targets
    "bench_storage": sum_storage,
    "bench_radix": sum_radix,
}


def summarise(name: str, d: dict[str, Any]) -> list[str]:
    fn = SUMMARIES.get(name, sum_generic)
    try:
        return fn(d)
    except (AttributeError, TypeError, KeyError) as e:
        return [f"(could not summarise: {e})", *sum_generic(d)]


# ---- running ----------------------------------------------------------------------------------


def run_one(script: Path, quick: bool, timeout: float, log_dir: Path) -> dict[str, Any]:
    name = script.stem
    argv = [sys.executable, str(script)]
    if quick and has_flag(script, "--quick"):
        argv.append("--quick")
        if has_flag(script, "--out"):
            # Keep full-size results (benchmarks/results/NAME.json) from being overwritten.
            argv += ["--out", str(RESULTS / f"{name}_quick.json")]
    log = log_dir / f"{name}.log"
    started = time.time()
    shown = " ".join(str(Path(x).relative_to(ROOT)) if x.startswith(str(ROOT)) else x
                     for x in argv[1:])
    print(f"== {name}: {shown}  (log: {log.relative_to(ROOT)})", flush=True)
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "HF_HUB_OFFLINE": "1"}
    rec: dict[str, Any] = {"name": name, "argv": argv[1:], "log": str(log.relative_to(ROOT))}
    with open(log, "wb") as f:
        try:
            proc = subprocess.run(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                  env=env, timeout=timeout, check=False)
            rec["returncode"] = proc.returncode
        except subprocess.TimeoutExpired:
            rec["returncode"] = None
            rec["error"] = f"timed out after {timeout:.0f}s"
    rec["seconds"] = round(time.time() - started, 1)
    if rec.get("returncode") not in (0,) and "error" not in rec:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        rec["error"] = f"exit code {rec['returncode']}: " + " / ".join(tail)
    out = RESULTS / f"{name}_quick.json"
    if "--out" in argv and out.is_file():
        found = [out]
    else:  # the benchmark names its own file: NAME*.json written during the run
        found = [p for p in new_json(started - 1) if p.name.startswith(name)]
    rec["json"] = [str(p.relative_to(ROOT)) for p in found]
    status = "ok" if "error" not in rec else f"FAILED ({rec['error'][:200]})"
    print(f"   {name}: {status} in {rec['seconds']}s; json: {', '.join(rec['json']) or '-'}",
          flush=True)
    return rec


def write_summary(records: list[dict[str, Any]], quick: bool) -> Path:
    lines = [
        "# Benchmark summary",
        "",
        f"`python benchmarks/run_all.py{'' if quick else ' --full'}` on "
        f"{platform.platform()}, {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "Sizes are the benchmarks' quick settings; compare ratios, not absolute times "
        "(shared, noisy machines).",
        "",
        *table(["benchmark", "status", "seconds", "JSON"],
               [[r["name"], "ok" if "error" not in r else "FAILED", r["seconds"],
                 ", ".join(f"`{j}`" for j in r["json"]) or "-"] for r in records]),
    ]
    for r in records:
        lines += ["", f"## {r['name']}", ""]
        if "error" in r:
            lines += [f"Skipped: {r['error']}", "", f"Log: `{r['log']}`"]
            continue
        for j in r["json"]:
            try:
                data = json.loads((ROOT / j).read_text())
            except (OSError, json.JSONDecodeError) as e:
                lines += [f"`{j}`: unreadable ({e})"]
                continue
            if len(r["json"]) > 1:
                lines += [f"`{j}`", ""]
            lines += summarise(r["name"], data if isinstance(data, dict) else {"data": data})
            lines.append("")
    out = RESULTS / "summary.md"
    out.write_text("\n".join(lines).rstrip() + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated benchmark names (default: all)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per benchmark")
    p.add_argument("--full", action="store_true", help="run without --quick (long)")
    a = p.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    log_dir = RESULTS / "logs"
    log_dir.mkdir(exist_ok=True)
    scripts = discover()
    if a.only:
        wanted = {n.strip() for n in a.only.split(",") if n.strip()}
        unknown = wanted - {s.stem for s in scripts}
        if unknown:
            p.error(f"unknown benchmarks: {', '.join(sorted(unknown))}")
        scripts = [s for s in scripts if s.stem in wanted]
    records = [run_one(s, not a.full, a.timeout, log_dir) for s in scripts]
    out = write_summary(records, not a.full)
    failed = [r["name"] for r in records if "error" in r]
    print(f"wrote {out.relative_to(ROOT)}; {len(records) - len(failed)} ok, "
          f"{len(failed)} failed{': ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
