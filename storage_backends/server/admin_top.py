"""`hicache-admin top`: a live terminal view of one running `hicache-server`.

    hicache-admin [--url URL] [--admin-token T] top [--metrics-url URL] [--interval S] [--once]

Every `--interval` seconds (default 1) it asks the admin API for the per-namespace stats
(tenants' pages, bytes, hits, misses, pins; the server's capacity and evictions) and, with
`--metrics-url` (the server's `--metrics-port`, `http://127.0.0.1:PORT/metrics`), reads its
Prometheus histogram of request latency: ops/s and p50/p99 latency per op over the last interval.
Rates and percentiles are over the interval between two samples. `q` or Ctrl-C ends it.
`--once` prints one frame (two samples an interval apart) and exits: for a pipe or a test.
"""

from __future__ import annotations

import argparse
import contextlib
import select
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from hicache_client.remote import protocol as P


@dataclass
class Sample:
    t: float
    namespaces: dict[str, dict[str, int]]
    totals: dict[str, int]
    # op -> (count, {upper bound: cumulative count}) of hicache_server_request_seconds
    latency: dict[str, tuple[float, dict[float, float]]] = field(default_factory=dict)


def read_latency(url: str, timeout_s: float = 2.0) -> dict[str, tuple[float, dict[float, float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 (an operator's URL)
        text = r.read().decode()
    out: dict[str, tuple[float, dict[float, float]]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != "hicache_server_request_seconds":
            continue
        for s in fam.samples:
            op = s.labels.get("op", "")
            count, buckets = out.get(op, (0.0, {}))
            if s.name.endswith("_bucket"):
                buckets[float(s.labels["le"])] = s.value
            elif s.name.endswith("_count"):
                count = s.value
            out[op] = (count, buckets)
    return out


def quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """The `q` quantile (seconds, the bucket's upper bound) of the observations between two
    cumulative histograms; None when there were none."""
    bounds = sorted(after)
    deltas = [after[b] - before.get(b, 0.0) for b in bounds]
    total = deltas[-1] if deltas else 0.0
    if total <= 0:
        return None
    for b, d in zip(bounds, deltas):
        if d >= q * total:
            return b
    return bounds[-1]


def sample(client: Any, metrics_url: str | None) -> Sample:
    r = client.call(P.AdminStatsRequest(), P.AdminStatsReply)
    lat = read_latency(metrics_url) if metrics_url else {}
    return Sample(time.monotonic(), dict(r.namespaces), dict(r.totals), lat)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}" if s < 1 else f"{s * 1e3:.0f}"


def frame(prev: Sample, cur: Sample, url: str) -> Any:
    """The rich renderable of one refresh: tenants, then ops and latency."""
    from rich.console import Group
    from rich.table import Table

    dt = max(cur.t - prev.t, 1e-9)
    tot = cur.totals
    ops = Table(title=f"hicache-server {url}", title_justify="left", expand=False)
    for col in ("tenant", "pages", "bytes", "hit rate", "gets/s", "hits", "misses", "pinned"):
        ops.add_column(col, justify="left" if col == "tenant" else "right")
    for ns, r in sorted(cur.namespaces.items(), key=lambda kv: -kv[1].get("bytes", 0)):
        p = prev.namespaces.get(ns, {})
        dh = r.get("hits", 0) - p.get("hits", 0)
        dm = r.get("misses", 0) - p.get("misses", 0)
        lookups = r.get("hits", 0) + r.get("misses", 0)
        rate = f"{r.get('hits', 0) / lookups:.1%}" if lookups else "-"
        ops.add_row(ns if ns == "-" else ns[:16], f"{r.get('pages', 0):,}",
                    _bytes(r.get("bytes", 0)), rate, f"{(dh + dm) / dt:,.1f}",
                    f"{r.get('hits', 0):,}", f"{r.get('misses', 0):,}",
                    _bytes(r.get("pinned_bytes", 0)))
    cap = tot.get("capacity_bytes", 0)
    ev = tot.get("evictions", 0) - prev.totals.get("evictions", 0)
    head = (f"memory {_bytes(tot.get('bytes', 0))} of {_bytes(cap)}"
            f" ({tot.get('bytes', 0) / cap:.0%})" if cap else f"memory {_bytes(tot.get('bytes', 0))}")
    head += (f"   pages {tot.get('pages', 0):,}   evictions {tot.get('evictions', 0):,}"
             f" ({ev / dt:,.1f}/s)   pinned {_bytes(tot.get('pinned_bytes', 0))}")
    parts: list[Any] = [head, ops]
    if cur.latency:
        lat = Table(title="requests (last interval)", title_justify="left")
        for col in ("op", "ops/s", "p50 ms", "p99 ms", "total"):
            lat.add_column(col, justify="left" if col == "op" else "right")
        for op, (count, buckets) in sorted(cur.latency.items()):
            pc, pb = prev.latency.get(op, (0.0, {}))
            lat.add_row(op, f"{(count - pc) / dt:,.1f}", _ms(quantile(0.5, pb, buckets)),
                        _ms(quantile(0.99, pb, buckets)), f"{count:,.0f}")
        parts.append(lat)
    parts.append("[dim]q or Ctrl-C to quit[/]")
    return Group(*parts)


@contextlib.contextmanager
def _keys() -> Iterator[Any]:
    """stdin in cbreak mode (a key at a time) when it is a terminal; else None."""
    if not sys.stdin.isatty():
        yield None
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    old = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)
        yield sys.stdin
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)


def _quit_pressed(keys: Any, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for a key; True on q."""
    if keys is None:
        time.sleep(timeout_s)
        return False
    ready, _, _ = select.select([keys], [], [], timeout_s)
    return bool(ready) and keys.read(1).lower() == "q"


def run_top(client: Any, a: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    con = Console() if sys.stdout.isatty() else Console(width=140)  # a pipe: no wrapping
    prev = sample(client, a.metrics_url)
    if a.once:
        time.sleep(a.interval)
        con.print(frame(prev, sample(client, a.metrics_url), a.url))
        return 0
    try:
        with _keys() as keys, Live(console=con, auto_refresh=False, screen=False) as live:
            while True:
                if _quit_pressed(keys, a.interval):
                    return 0
                cur = sample(client, a.metrics_url)
                live.update(frame(prev, cur, a.url), refresh=True)
                prev = cur
    except KeyboardInterrupt:
        return 0


def add_parser(sub: Any, json_flag: Any) -> None:
    top = sub.add_parser("top", help="a live view: tenants, bytes, hit rate, ops/s, latency "
                         "percentiles, evictions (q or Ctrl-C quits)")
    top.add_argument("--metrics-url", help="the server's /metrics (its --metrics-port), for "
                     "ops/s and latency percentiles per op")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    top.add_argument("--once", action="store_true",
                     help="print one frame (two samples an interval apart) and exit")
