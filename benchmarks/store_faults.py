"""What a client process pays to copy into pages of hicache-server's store that it has not
touched yet, with and without `shm_populate` (docs/hicache-server.md, "Mapping ahead").

Per repeat: a fresh arena whose first `--mb` MiB hold records (written once through the
server's mapping, as in a server that has run a while); then a new mapping of it, as a new
engine process has, copies 1 MiB into each of those records:

- `cold`: `shm_populate` off: every 4 KiB page faults on its first copy;
- `populated`: a mapping whose background populate has finished (its time is `populate`);
- `warm`: the same copies again through a mapping that has touched every page.

Prints and writes JSON (`--out`): per case the median seconds and MB/s over the repeats, and
the ratios to `warm`.

    python benchmarks/store_faults.py --mb 256 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hicache_client.remote.store import StoreMap  # noqa: E402
from storage_backends.server.arena import Arena  # noqa: E402

MiB = 1 << 20


def _copy_all(m: StoreMap, slots: list[tuple[int, int]], src: memoryview) -> float:
    t0 = time.perf_counter()
    for off, gen in slots:
        if not m.write(off, gen, src):
            raise RuntimeError("a slot of the arena moved")
    return time.perf_counter() - t0


def one_repeat(mb: int) -> dict[str, float]:
    arena = Arena((mb + 64) * MiB)
    try:
        src = memoryview(os.urandom(MiB))
        held = [arena.store(src) for _ in range(mb)]
        if any(s is None for s in held):
            raise RuntimeError("the arena could not hold the records (/dev/shm full?)")
        slots = [(s.offset, s.gen) for s in held if s is not None]
        cold = StoreMap(arena.name, arena.size, arena.id, populate=False)
        out = {"cold": _copy_all(cold, slots, src)}
        out["warm"] = _copy_all(cold, slots, src)
        cold.close()
        t0 = time.perf_counter()
        ahead = StoreMap(arena.name, arena.size, arena.id)
        assert ahead.populator is not None
        if not ahead.populator.wait(120) or not ahead.populator.enabled:
            raise RuntimeError("MADV_POPULATE_WRITE refused here (Linux before 5.14?)")
        out["populate"] = time.perf_counter() - t0
        out["populated"] = _copy_all(ahead, slots, src)
        ahead.close()
        return out
    finally:
        arena.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=256, help="MiB of held records copied into")
    p.add_argument("--repeat", type=int, default=5, help="fresh arenas; medians reported")
    p.add_argument("--out", default="benchmarks/results/store_faults.json")
    args = p.parse_args(argv)
    runs = []
    for i in range(args.repeat):
        runs.append(one_repeat(args.mb))
        print(f"  repeat {i + 1}/{args.repeat}: " + ", ".join(
            f"{k} {v * 1e3:.1f} ms" for k, v in runs[-1].items()), file=sys.stderr)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    pages = args.mb * MiB // 4096
    cases = {k: {"seconds": round(v, 5), "mb_s": round(args.mb / v, 1) if k != "populate"
                 else None, "vs_warm": round(v / med["warm"], 2)} for k, v in med.items()}
    report = {"benchmark": "store_faults", "args": vars(args), "cases": cases,
              "per_repeat": runs, "pages_4k": pages,
              "fault_us_per_page": round((med["cold"] - med["warm"]) / pages * 1e6, 2),
              "populate_us_per_page": round(med["populate"] / pages * 1e6, 2),
              "host": {"platform": platform.platform(), "cpus": os.cpu_count()}}
    for k, c in cases.items():
        print(f"{k:>10}: {c['seconds'] * 1e3:8.1f} ms  ({c['vs_warm']}x warm)")
    print(f"fault: {report['fault_us_per_page']} us a page; populate: "
          f"{report['populate_us_per_page']} us a page")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
