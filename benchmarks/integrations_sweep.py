"""The sweep both integration benchmarks run (integrations_sglang.py, integrations_lmcache.py):
start the named targets once, then per client count, repeat and target (interleaved) one run,
and one row per (target, op, clients) with every repeat's MB/s and their median."""

from __future__ import annotations

import statistics
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

MiB = 1 << 20


def sweep(
    plugin: str, args: Any, names: Iterable[str], starters: Mapping[str, Callable[..., Any]],
    builtin: set[str], ops: Iterable[str], batch_bytes: int, ws_mb_default: int,
    run: Callable[[Any, int, int, int, int, int], dict[str, dict[str, float]]],
) -> list[dict[str, Any]]:
    """Rows `{"plugin", "target", "builtin", "op", "clients", "page_bytes", "mb_s": [per
    repeat], "mb_s_median", "misses": [per repeat]}`. `starters[name](tmp, ws_bytes)` is a
    context manager yielding started targets (each with a `name`); `run(target, clients,
    batch, pages_per_client, repeat, run_number)` returns per op `{"mb_s", "misses"}`, misses
    -1 for a run that measured nothing (a client failed): the median is over the others (0
    when none ran). `args`: `clients`, `page_bytes`, `seconds`, `repeat`, optional
    `working_set_mb` (all clients together)."""
    names = list(names)
    unknown = set(names) - set(starters)
    if unknown:
        raise ValueError(f"unknown {plugin} targets {sorted(unknown)}; known: {list(starters)}")
    page = int(args.page_bytes)
    ws_bytes = int(getattr(args, "working_set_mb", None) or ws_mb_default) * MiB
    samples: dict[tuple[str, str, int], list[tuple[float, int]]] = {}
    runs = 0
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"{plugin}-bench-")))
        targets: list[Any] = []
        for starter in dict.fromkeys(starters[n] for n in names):
            started = stack.enter_context(starter(tmp, ws_bytes))
            targets += [t for t in started if t.name in names]
        for n in [int(c) for c in args.clients]:
            batch = max(1, batch_bytes // page)
            per_client = max(batch, ws_bytes // n // page)
            per_client = -(-per_client // batch) * batch  # whole batches
            for rep in range(int(args.repeat)):
                for t in targets:
                    print(f"  {plugin} {t.name:<14} x{n} rep {rep + 1}", file=sys.stderr)
                    runs += 1
                    res = run(t, n, batch, per_client, rep, runs)
                    for op in ops:
                        samples.setdefault((t.name, op, n), []).append(
                            (res[op]["mb_s"], int(res[op]["misses"])))
    rows = []
    for (name, op, n), got in samples.items():
        mbs = [round(m, 1) for m, _ in got]
        ran = [m for m, (_, x) in zip(mbs, got) if x >= 0]
        rows.append({"plugin": plugin, "target": name, "builtin": name in builtin, "op": op,
                     "clients": n, "page_bytes": page, "mb_s": mbs,
                     "mb_s_median": statistics.median(ran) if ran else 0.0,
                     "misses": [x for _, x in got]})
    return rows
