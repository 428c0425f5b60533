"""The Grafana dashboard (deploy/grafana/hicache.json) against a real Prometheus (Debian's
`prometheus`) that scrapes a live engine (demo model, L3 on a live hicache-server) and that
server, on loopback ports, under a small load: every panel's query returns data through the
HTTP API, and every metric it names exists. Both /metrics pass the naming checks
(tests/metrics_names.py). With HICACHE_RENDER_DASHBOARD=PATH the panels' query results over the
run are drawn with matplotlib into PATH (docs/img/dashboard.png: a rendering of the panels, not
Grafana)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.engine.test_server_api import EngineServer
from tests.engine.test_server_multi import L3_FLAGS, LONG_PROMPT, generate
from tests.metrics_names import check_exposition
from tests.procs import ManagedProcess, free_port
from tests.storage_backends.hicache_server_proc import HiCacheServerProc

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "hicache.json"
METRIC = re.compile(r"\b(hicache(?::|_server_)[a-z0-9_:]+)")
WINDOW = "1m"  # what $__rate_interval is evaluated as

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("prometheus") is None,
                       reason="needs Debian's prometheus (scripts/install_system_deps.sh)"),
]


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return str(r.read().decode())


def query(prom: str, expr: str) -> list[Any]:
    doc = get(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert doc["status"] == "success", (expr, doc)
    return list(doc["data"]["result"])


def _try_query(prom: str, expr: str) -> list[Any]:
    try:
        return query(prom, expr)
    except OSError:  # not listening yet
        return []


def targets() -> list[tuple[str, str, str]]:
    d = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["legendFormat"], t["expr"].replace("$__rate_interval", WINDOW))
            for p in d["panels"] for t in p["targets"]]


def test_the_json_is_the_panel_spec() -> None:
    out = subprocess.run([sys.executable, str(REPO / "deploy/grafana/panels.py")],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == json.loads(DASHBOARD.read_text())


def test_every_panel_query_returns_data(tmp_path: Path) -> None:
    mport = free_port()
    store = HiCacheServerProc(tmp_path, capacity="256MiB", metrics_port=mport).start()
    flags = [*L3_FLAGS, "--hicache-storage-backend", "hicache", "--enable-metrics",
             "--hicache-storage-backend-extra-config", json.dumps({"url": store.url})]
    eng = EngineServer(tmp_path, flags, name="engine").start()
    pport = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: engine\n    static_configs: [{{targets: ['127.0.0.1:{eng.port}']}}]\n"
        f"  - job_name: hicache-server\n    static_configs: [{{targets: ['127.0.0.1:{mport}']}}]\n")
    prom_proc = ManagedProcess(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{pport}"],
        tmp_path / "prometheus.log", cwd=tmp_path)
    prom = f"http://127.0.0.1:{pport}"
    try:
        eng.wait_ready()
        prom_proc.start()
        for _ in range(600):  # both scraped once: the load's counters rise under Prometheus
            if len([r for r in _try_query(prom, "up") if r["value"][1] == "1"]) == 2:
                break
            time.sleep(0.1)
        t0 = time.time()
        # A small load: new prompts, repeats (device hits), a flush (L3 hits), a bad request.
        for rnd in range(3):
            for i in range(2):
                generate(eng, f"{rnd} {i} {LONG_PROMPT}")
                generate(eng, f"{rnd} {i} {LONG_PROMPT}")
            eng.wait_transfers()
            eng.post("/flush_cache", {})
            for i in range(2):
                generate(eng, f"{rnd} {i} {LONG_PROMPT}")
            time.sleep(1.0)  # (spread over scrapes, for the picture; no assertion times it)
        with eng.client() as c:
            assert c.post("/generate", json={"text": "x", "bogus_field": 1}).status_code == 400
        check_exposition(text(f"{eng.url}/metrics"))
        check_exposition(text(f"http://127.0.0.1:{mport}/metrics"), bounded_ids=("namespace",))
        # Wait (bounded) until Prometheus holds a few scrapes of both after the load.
        for _ in range(600):
            up = query(prom, "count_over_time(up[1m])")
            if len(up) == 2 and all(float(r["value"][1]) >= 4 for r in up):
                break
            time.sleep(0.1)
        up = {r["metric"]["job"]: r["value"][1] for r in query(prom, "up")}
        assert up == {"engine": "1", "hicache-server": "1"}
        results: dict[tuple[str, str, str], list[Any]] = {}
        for t in targets():
            res = query(prom, t[2])
            assert res, f"no data: {t}"
            results[t] = res
            for name in set(METRIC.findall(t[2])):
                name = re.sub(r"_(bucket|count|sum)$", "", name)
                assert query(prom, f'count({{__name__=~"{name}(_bucket|_total)?"}})'), name
        causes = {r["metric"]["cause"] for r in query(prom, "hicache:miss_tokens_total")}
        from hicache.attribution import MISS_CAUSES

        assert causes == set(MISS_CAUSES)
        assert float(query(prom, 'sum(hicache:miss_tokens_total{cause="never_seen"})')[0]
                     ["value"][1]) > 0
        out = os.environ.get("HICACHE_RENDER_DASHBOARD")
        if out:
            render(prom, t0, time.time(), Path(out))
    finally:
        prom_proc.stop(timeout=30)
        eng.stop()
        store.stop()


def render(prom: str, start: float, end: float, path: Path) -> None:
    """Each panel's queries over the run, one subplot a panel (a picture of the panels' data,
    not Grafana's rendering)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = json.loads(DASHBOARD.read_text())
    panels = d["panels"]
    cols = 2
    rows = (len(panels) + 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(14, 3.0 * rows), squeeze=False)
    for ax, p in zip(axes.flat, panels):
        for t in p["targets"]:
            expr = t["expr"].replace("$__rate_interval", WINDOW)
            doc = get(f"{prom}/api/v1/query_range?" + urllib.parse.urlencode(
                {"query": expr, "start": start, "end": end + 1, "step": 1}))
            for s in doc["data"]["result"]:
                xs = [float(v[0]) - start for v in s["values"]]
                ys = [float(v[1]) for v in s["values"]]
                labels = s["metric"]
                legend = re.sub(r"\{\{(\w+)\}\}",
                                lambda m, lb=labels: str(lb.get(m.group(1), "")),
                                t["legendFormat"])
                if any(y == y and y != 0 for y in ys):  # skip all-zero / NaN series
                    ax.plot(xs, ys, label=legend[:28])
        ax.set_title(p["title"], fontsize=9)
        ax.tick_params(labelsize=7)
        if ax.lines:
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("deploy/grafana/hicache.json: the panels' Prometheus data from the test run "
                 "(seconds since the load began; matplotlib, not Grafana)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
