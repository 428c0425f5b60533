"""A pytest plugin for scripts/gpu_check.sh: one line per finished test, written as it ends.

`-p gpu_report` with `GPU_REPORT=<file>` set (scripts/ on PYTHONPATH). Each test appends
`outcome<TAB>test id<TAB>first line` to the file the moment its report reaches the controller
(pytest-xdist included), so a run cut at its time limit still says what passed and what failed.
The first line of a failure is its first `E ` line (the assertion or the exception); of a skip,
its reason. `python scripts/gpu_report.py <file>` prints the compact summary: the counts, every
failure and error with its first line, and the skip reasons with how many tests each skipped.
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Any


def _first_line(report: Any) -> str:
    if report.skipped:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        return reason.removeprefix("Skipped: ")
    text = getattr(report, "longreprtext", "") or ""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("E "):
            return ln[2:].strip()[:300]
    return (lines[-1] if lines else "").strip()[:300]


_WORKER = False  # an xdist worker: its reports reach the controller, which writes them


def pytest_configure(config: Any) -> None:
    global _WORKER
    _WORKER = hasattr(config, "workerinput")


def pytest_runtest_logreport(report: Any) -> None:
    path = os.environ.get("GPU_REPORT")
    if not path or _WORKER:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome = report.outcome
    elif report.when == "teardown" and report.failed:
        outcome = "error"
    else:
        return
    if report.when == "setup" and report.failed:
        outcome = "error"
    line = "" if outcome == "passed" else _first_line(report).replace("\t", " ").replace("\n", " ")
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{outcome}\t{report.nodeid}\t{line}\n")


def summarize(path: str) -> tuple[str, int]:
    """The summary text and the number of failures and errors."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for raw in f:
            parts = raw.rstrip("\n").split("\t", 2)
            if len(parts) == 3:
                rows.append(parts)
    counts = collections.Counter(r[0] for r in rows)
    bad = sorted((r for r in rows if r[0] in ("failed", "error")), key=lambda r: r[1])
    skips = collections.Counter(r[2] for r in rows if r[0] == "skipped")
    out = [", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no test finished"]
    for outcome, nodeid, first in bad:
        out.append(f"{outcome.upper()} {nodeid}\n    {first}")
    if skips:
        out.append("skip reasons:")
        out.extend(f"  {n:4d}  {reason}" for reason, n in skips.most_common(15))
    return "\n".join(out), len(bad)


if __name__ == "__main__":
    text, n_bad = summarize(sys.argv[1])
    print(text)
    sys.exit(1 if n_bad else 0)
