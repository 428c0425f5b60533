"""The panels of deploy/grafana/hicache.json, written once here and turned into the dashboard
JSON (`python deploy/grafana/panels.py > deploy/grafana/hicache.json`). The dashboard test
(tests/deployment/test_dashboard.py) evaluates every query against a real Prometheus that
scraped a live engine and hicache-server, and checks that the JSON is this file's output.

Engine metrics carry the `hicache:` prefix (SGLang's `sglang:` style); the server's are
`hicache_server_*`. `$__rate_interval` is Grafana's; the test evaluates it as 1m.
"""

from __future__ import annotations

import json

R = "$__rate_interval"
# (title, unit, [(legend, PromQL)])
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Hit rate per tier (prompt tokens)", "percentunit", [
        (tier, f"sum(rate(hicache:{tier}_hit_tokens_total[{R}])) / "
               f"clamp_min(sum(rate(hicache:cache_input_tokens_total[{R}])), 1)")
        for tier in ("device", "host", "storage")
    ]),
    ("Why it missed: prompt tokens by miss cause /s", "short", [
        ("{{cause}}", f"sum by (cause) (rate(hicache:miss_tokens_total[{R}]))"),
    ]),
    ("TTFT p50 / p99 by cached fraction", "s", [
        (f"p{q} {{{{cached_fraction}}}}",
         f"histogram_quantile(0.{q}, sum by (le, cached_fraction) "
         f"(rate(hicache:time_to_first_token_by_cached_fraction_seconds_bucket[{R}])))")
        for q in ("5", "99")
    ]),
    ("L3 bandwidth (engine side)", "Bps", [
        ("prefetch read", f"rate(hicache:prefetched_bytes_total[{R}])"),
        ("backup write", f"rate(hicache:backuped_bytes_total[{R}])"),
    ]),
    ("hicache-server bytes in / out by path", "Bps", [
        ("{{path}} {{dir}}", f"sum by (path, dir) (rate(hicache_server_page_bytes_total[{R}]))"),
    ]),
    ("hicache-server latency p50 / p99 by op", "s", [
        (f"p{q} {{{{op}}}}", f"histogram_quantile(0.{q}, sum by (le, op) "
                             f"(rate(hicache_server_request_seconds_bucket[{R}])))")
        for q in ("5", "99")
    ]),
    ("Prefetch outcomes of L3-held tokens /s", "short", [
        ("{{outcome}}",
         f"sum by (outcome) (rate(hicache:storage_hit_outcome_tokens_total[{R}]))"),
    ]),
    ("Tenants: bytes held and caps", "bytes", [
        ("{{namespace}} {{tier}}", "sum by (namespace, tier) (hicache_server_namespace_bytes)"),
        ("memory held", "hicache_server_bytes"),
        ("memory capacity", "hicache_server_capacity_bytes"),
        ("pinned", "hicache_server_pinned_bytes"),
    ]),
    ("hicache-server hit rate", "percentunit", [
        ("hits / gets", f"rate(hicache_server_hits_total[{R}]) / clamp_min("
                        f"rate(hicache_server_hits_total[{R}]) + "
                        f"rate(hicache_server_misses_total[{R}]), 1e-9)"),
    ]),
    ("Errors and evictions /s", "short", [
        ("engine L3 errors", f"rate(hicache:storage_errors_total[{R}])"),
        ("engine corrupt pages", f"rate(hicache:corrupt_pages_total[{R}])"),
        ("engine 4xx", f"rate(hicache:num_bad_requests_total[{R}])"),
        ("server evictions", f"rate(hicache_server_evictions_total[{R}])"),
        ("device evicted tokens", f"rate(hicache:evicted_tokens_total[{R}])"),
    ]),
    ("Requests and KV pool", "short", [
        ("running", "hicache:num_running_reqs"),
        ("waiting", "hicache:num_queue_reqs"),
        ("device pool used", "hicache:token_usage"),
    ]),
]


def dashboard() -> dict[str, object]:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1,
            "type": "timeseries",
            "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [
                {"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend}
                for j, (legend, expr) in enumerate(targets)
            ],
        })
    return {
        "title": "HiCache: engine and hicache-server",
        "uid": "hicache",
        "schemaVersion": 38,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "tags": ["hicache", "kv-cache"],
        "templating": {"list": [{
            "name": "datasource", "type": "datasource", "query": "prometheus",
            "label": "Prometheus",
        }]},
        "panels": panels,
    }


if __name__ == "__main__":
    print(json.dumps(dashboard(), indent=2))
