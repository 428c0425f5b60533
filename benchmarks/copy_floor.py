"""The floor under a same-host get: how fast one core copies pages out of shared memory, bare and
with the XXH3 pass every checked read makes, in one run.

A same-host `hicache` get (the SGLang plugin, the LMCache connector, the `hicache` backend) is at
best one copy from the server's shared-memory store into the engine's buffer plus one XXH3 pass
over the bytes landed; a store that serves a client from its own memory (Mooncake's store with
one client) is one copy. This measures both on this machine, so a get figure can be read against
what the memory allows: `copy` (memcpy of each page), `copy+xxh3` (memcpy, then XXH3-64 of the
destination, as the client checks a record where it landed). Pages come from a `/dev/shm`-backed
mapping larger than the last-level cache and go to a torch buffer, cycling, so neither side is
cache-resident. MB/s is MiB copied per second; median of `--repeat`.

    python benchmarks/copy_floor.py --page-bytes 1MiB --working-set-mb 256 --repeat 7
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def measure(page: int, ws_bytes: int, repeat: int, min_s: float) -> dict[str, list[float]]:
    n = max(1, ws_bytes // page)
    shm = mmap.mmap(-1, n * page)  # anonymous shared mapping: what a /dev/shm store maps to
    src = memoryview(shm)
    src[:] = torch.randint(0, 256, (n * page,), dtype=torch.uint8).numpy().tobytes()
    dst_t = torch.empty(n * page, dtype=torch.uint8)
    dst = memoryview(dst_t.numpy()).cast("B")

    def copy(i: int) -> None:
        o = i * page
        dst[o : o + page] = src[o : o + page]

    def copy_hash(i: int) -> None:
        o = i * page
        dst[o : o + page] = src[o : o + page]
        xxhash.xxh3_64_intdigest(dst[o : o + page])

    kinds: dict[str, Callable[[int], None]] = {"copy": copy, "copy+xxh3": copy_hash}
    out: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(repeat):
        for name, f in kinds.items():  # interleaved: both see the same machine
            done, t0 = 0, time.perf_counter()
            while True:
                for i in range(n):
                    f(i)
                done += n
                dt = time.perf_counter() - t0
                if dt >= min_s:
                    break
            out[name].append(done * page / MiB / dt)
    src.release()
    shm.close()
    return out


def main(argv: list[str] | None = None) -> int:
    from hicache_client.units import parse_bytes

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--page-bytes", default="1MiB", help="bytes per page (default 1MiB)")
    p.add_argument("--working-set-mb", type=int, default=256,
                   help="MiB of pages cycled over; above the last-level cache (default 256)")
    p.add_argument("--repeat", type=int, default=7, help="runs per kind; median (default 7)")
    p.add_argument("--seconds", type=float, default=0.5, help="least time per run (default 0.5)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "copy_floor.json"),
                   help="JSON output path")
    a = p.parse_args(argv)
    page = parse_bytes(a.page_bytes, what="--page-bytes")
    got = measure(page, a.working_set_mb * MiB, a.repeat, a.seconds)
    rows = {k: {"mb_s": [round(x, 1) for x in v], "mb_s_median": round(statistics.median(v), 1)}
            for k, v in got.items()}
    ratio = round(rows["copy+xxh3"]["mb_s_median"] / rows["copy"]["mb_s_median"], 2)
    for k, r in rows.items():
        print(f"{k:<10} {r['mb_s_median']:>9.1f} MB/s  {r['mb_s']}")
    print(f"copy+xxh3 / copy: {ratio:.2f}x")
    from benchmarks.common import save_json

    save_json(a.out, {"benchmark": "copy_floor", "args": vars(a), "rows": rows,
                      "ratio_checked_to_bare": ratio})
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
