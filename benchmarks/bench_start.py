"""Time from `hicache-engine` launch to a healthy `/health`, on a first start (the GGUF converted
into an empty model cache) and on later starts (the converted checkpoint read back), in one run.

    python benchmarks/bench_start.py [--model smollm2-135m-instruct] [--baseline hicache-demo]
        [--starts 3] [--out PATH]

The first start dequantizes the GGUF and writes the cached checkpoint (engine/models/gguf.py);
the others only load it. The model cache is a fresh temporary directory
(`HICACHE_MODEL_CACHE_DIR`), so the first start is a first start whatever ran before. Prints
each start and writes JSON (medians of the later starts). `--baseline` starts another model the
same way in the same run (the seeded demo model by default: the engine's own start-up cost with
a model that takes no time to load), so the GGUF's share is the difference."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.procs import free_port  # noqa: E402


def one_start(model: str, env: dict[str, str], timeout_s: float = 600.0) -> float:
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "--model-path", model, "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - t0 < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"hicache-engine exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("not healthy in time")
    finally:
        proc.terminate()
        proc.wait(30)


def measure(model: str, starts: int) -> dict[str, object]:
    """A first start into an empty model cache, then `starts` more."""
    with tempfile.TemporaryDirectory(prefix="bench-start-") as cache:
        env = {**os.environ, "HICACHE_MODEL_CACHE_DIR": cache, "LMCACHE_TRACK_USAGE": "false"}
        first = one_start(model, env)
        print(f"{model}: first start {first:.2f} s", flush=True)
        later = []
        for i in range(starts):
            later.append(one_start(model, env))
            print(f"{model}: start {i + 2} {later[-1]:.2f} s", flush=True)
    return {"first_start_s": round(first, 3), "later_starts_s": [round(x, 3) for x in later],
            "later_start_median_s": round(statistics.median(later), 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a GGUF file or catalog name (default: smollm2-135m-instruct)")
    p.add_argument("--baseline", default="hicache-demo",
                   help="another model started the same way in this run ('' for none)")
    p.add_argument("--starts", type=int, default=3, help="starts after the first (median)")
    p.add_argument("--out", type=Path,
                   default=ROOT / "benchmarks/results/bench_start.json")
    a = p.parse_args(argv)
    out: dict[str, object] = {"model": a.model, **measure(a.model, a.starts)}
    if a.baseline:
        out["baseline"] = {"model": a.baseline, **measure(a.baseline, a.starts)}
    out.update({"target_later_start_s": 5.0,
                "met": float(out["later_start_median_s"]) <= 5.0,  # type: ignore[arg-type]
                "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                            "loadavg": os.getloadavg()}})
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
