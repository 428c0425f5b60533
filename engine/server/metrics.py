"""Prometheus metrics of the engine server (`/metrics` with `--enable-metrics`).

Names follow SGLang's where SGLang has the metric, under a `hicache:` prefix. Request metrics
(TTFT, inter-token latency, token counters) are measured in the front end; cache metrics come
from the scheduler's `cache_stats()` snapshot, refreshed at each scrape.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hicache.attribution import MISS_CAUSES
from hicache.stats import STORAGE_HIT_OUTCOMES

PREFIX = "hicache:"

# (metric name without _total, CacheStats field, help) for counters read from the snapshot.
CACHE_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("prefetched_tokens", "prefetch_tokens", "Tokens prefetched from L3 storage into host memory."),
    ("prefetched_pages", "prefetch_pages", "Pages prefetched from L3 storage."),
    ("prefetched_bytes", "prefetch_bytes", "Bytes read from L3 storage by prefetches."),
    ("backuped_pages", "storage_backup_pages", "Pages written to L3 storage."),
    ("backuped_bytes", "storage_backup_bytes", "Bytes written to L3 storage."),
    ("evicted_tokens", "evicted_tokens", "Device (L1) KV tokens evicted."),
    ("evicted_host_tokens", "evicted_host_tokens", "Host (L2) KV tokens evicted."),
    ("host_backup_tokens", "backup_tokens", "Tokens copied from device to host memory."),
    ("load_back_tokens", "load_back_tokens", "Tokens loaded back from host memory to device."),
    ("device_hit_tokens", "device_hit_tokens", "Prompt tokens served from the device tier (L1)."),
    ("host_hit_tokens", "host_hit_tokens", "Prompt tokens served from host memory (L2)."),
    ("storage_hit_tokens", "storage_hit_tokens", "Prompt tokens served from L3 storage."),
    ("cache_input_tokens", "input_tokens", "Prompt tokens looked up in the cache."),
    ("storage_errors", "storage_errors", "L3 backend operations that raised."),
    ("storage_failed_pages", "storage_failed_pages", "L3 page writes the backend refused."),
    ("corrupt_pages", "corrupt_pages", "L3 records that failed validation on read."),
    ("storage_probed_tokens", "storage_probed_tokens",
     "Prompt tokens L3 held when requests' prefetches asked (each comes to one outcome)."),
    ("storage_declined_pages", "storage_declined_pages",
     "Backed-up pages L3 admission kept out of L3 (--hicache-storage-admission)."),
    ("storage_declined_rehit_pages", "storage_declined_rehit_pages",
     "Pages recomputed while in the sketch of declined pages: hits L3 would have served."),
    ("skip_write_pages", "skip_write_pages",
     "New pages of skip_cache_write requests (kept on the device only)."),
    ("retention_requests", "retention_requests", "Requests whose retention_seconds soft-pinned "
     "their prefix."),
    ("retention_clamped", "retention_clamped",
     "Retention requests cut to --max-retention-seconds."),
    ("retention_expired", "retention_expired", "Soft pins (tree nodes) that ran out."),
)
# (name without _total, help, label, snapshot key of a dict, the label's values).
LABELLED_COUNTERS: tuple[tuple[str, str, str, str, tuple[str, ...]], ...] = (
    ("storage_hit_outcome_tokens",
     "Storage-hit tokens by where they went (hicache.stats.STORAGE_HIT_OUTCOMES).",
     "outcome", "storage_hit_outcomes", STORAGE_HIT_OUTCOMES),
    ("miss_tokens",
     "Prompt tokens no cache tier served, by cause (hicache.attribution.MISS_CAUSES).",
     "cause", "prompt_outcomes", MISS_CAUSES),
)
# (gauge name, usage key, help) for pool occupancy.
USAGE_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("device_pages_total", "device_pages_total", "Pages of the device KV pool."),
    ("device_pages_free", "device_pages_free", "Free pages of the device KV pool."),
    ("host_pages_total", "host_pages_total", "Pages of the host KV pool."),
    ("host_pages_free", "host_pages_free", "Free pages of the host KV pool."),
    ("pending_prefetches", "pending_prefetches", "Storage prefetches in flight."),
    ("pending_transfers", "pending_transfers", "Cache transfers in flight."),
)
LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0,
)
BANDWIDTH_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)


class _CacheCollector(Collector):
    """Counters and gauges from the latest scheduler snapshot."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if not s:
            return
        usage: Mapping[str, Any] = s.get("usage") or {}
        sched: Mapping[str, Any] = s.get("scheduler") or {}
        page = int(usage.get("page_size", 1) or 1)
        g = GaugeMetricFamily(
            PREFIX + "cache_hit_rate", "Cached prompt tokens / prompt tokens (all tiers)."
        )
        g.add_metric([], float(s.get("hit_rate", 0.0)))
        yield g
        for name, key, doc in CACHE_COUNTERS:
            c = CounterMetricFamily(PREFIX + name, doc)
            c.add_metric([], float(s.get(key, 0)))
            yield c
        for name, doc, label, key, values in LABELLED_COUNTERS:
            c = CounterMetricFamily(PREFIX + name, doc, labels=[label])
            got: Mapping[str, Any] = s.get(key) or {}
            for v in values:  # every value, always: a fixed label set
                c.add_metric([v], float(got.get(v, 0)))
            yield c
        c = CounterMetricFamily(PREFIX + "backuped_tokens", "Tokens written to L3 storage.")
        c.add_metric([], float(s.get("storage_backup_pages", 0)) * page)
        yield c
        for name, key, doc in (
            ("num_running_reqs", "running", "Requests being decoded."),
            ("num_queue_reqs", "waiting", "Requests waiting to be admitted."),
        ):
            g = GaugeMetricFamily(PREFIX + name, doc)
            g.add_metric([], float(sched.get(key, 0)))
            yield g
        c = CounterMetricFamily(PREFIX + "retracted_reqs", "Requests retracted for lack of KV.")
        c.add_metric([], float(sched.get("retractions", 0)))
        yield c
        total = float(usage.get("device_pages_total", 0))
        free = float(usage.get("device_pages_free", 0))
        g = GaugeMetricFamily(PREFIX + "token_usage", "Fraction of the device KV pool in use.")
        g.add_metric([], (total - free) / total if total else 0.0)
        yield g
        for name, key, doc in USAGE_GAUGES:
            if key in usage:
                g = GaugeMetricFamily(PREFIX + name, doc)
                g.add_metric([], float(usage[key]))
                yield g


# The front end's own metrics: (attribute, name without prefix, help, histogram buckets or None
# for a counter).
SERVER_METRICS: tuple[tuple[str, str, str, tuple[float, ...] | None], ...] = (
    ("ttft", "time_to_first_token_seconds", "Time to first token in seconds.", LATENCY_BUCKETS),
    ("itl", "inter_token_latency_seconds", "Time between output tokens in seconds.",
     LATENCY_BUCKETS),
    ("e2e", "e2e_request_latency_seconds", "End-to-end request latency in seconds.",
     LATENCY_BUCKETS),
    ("prefetch_bw", "prefetch_bandwidth", "L3 prefetch bandwidth in GB/s (sampled).",
     BANDWIDTH_BUCKETS),
    ("backup_bw", "backup_bandwidth", "L3 backup bandwidth in GB/s (sampled).", BANDWIDTH_BUCKETS),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens of finished requests.", None),
    ("generation_tokens", "generation_tokens", "Generated tokens of finished requests.", None),
    ("cached_tokens", "cached_tokens", "Prompt tokens served from the cache.", None),
    ("requests", "num_requests", "Finished requests.", None),
    ("aborted", "num_aborted_requests", "Requests aborted (client gone or unservable).", None),
    ("bad_requests", "num_bad_requests", "Requests answered with a 4xx error.", None),
)


# Distinct unknown field names counted by name; past this many (or a name that is long or odd),
# they count as "(other)": a client must not grow the label set without bound.
MAX_UNKNOWN_FIELD_LABELS = 64
_FIELD_LABEL = re.compile(r"[A-Za-z0-9_.]{1,64}")
_INDEX = re.compile(r"\.\d+(?=\.|$)")


class ServerMetrics:
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    prefetch_bw: Histogram
    backup_bw: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    cached_tokens: Counter
    requests: Counter
    aborted: Counter
    bad_requests: Counter

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        for attr, name, doc, buckets in SERVER_METRICS:
            metric = (Counter(PREFIX + name, doc, registry=r) if buckets is None
                      else Histogram(PREFIX + name, doc, buckets=buckets, registry=r))
            setattr(self, attr, metric)
        self.refused_fields = Counter(
            PREFIX + "refused_request_fields",
            "Request fields refused with a 400, by field (list positions as *) and reason "
            "(unsupported: a value the engine cannot honour; unknown: no API defines it).",
            ["field", "reason"], registry=r)
        self._unknown_labels: set[str] = set()
        self.ttft_cached = Histogram(
            PREFIX + "time_to_first_token_by_cached_fraction_seconds",
            "Time to first token in seconds, by the fraction of the prompt the cache served "
            "(cached_fraction: none, under_half, half_to_90, over_90).",
            ["cached_fraction"], buckets=LATENCY_BUCKETS, registry=r)
        self.cache = _CacheCollector()
        r.register(self.cache)

    def refused(self, fields: Mapping[str, str]) -> None:
        """Count each refused field of one request (`ApiError.fields`)."""
        for name, reason in fields.items():
            label = _INDEX.sub(".*", name)
            if reason == "unknown" and label not in self._unknown_labels:
                if len(self._unknown_labels) < MAX_UNKNOWN_FIELD_LABELS and \
                        _FIELD_LABEL.fullmatch(label):
                    self._unknown_labels.add(label)
                else:
                    label = "(other)"
            self.refused_fields.labels(label, reason).inc()

    def first_token(self, seconds: float, prompt: int, cached: int) -> None:
        self.ttft.observe(seconds)
        f = cached / prompt if prompt else 0.0
        band = ("none" if cached <= 0 else "under_half" if f < 0.5 else "half_to_90"
                if f < 0.9 else "over_90")
        self.ttft_cached.labels(band).observe(seconds)

    def finished(self, prompt: int, completion: int, cached: int, e2e: float) -> None:
        self.requests.inc()
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(completion)
        self.cached_tokens.inc(cached)
        self.e2e.observe(e2e)

    def update(self, snapshot: dict[str, Any]) -> None:
        bw = snapshot.pop("bandwidth", None) or {}
        for v in bw.get("prefetch", []):
            self.prefetch_bw.observe(v)
        for v in bw.get("backup", []):
            self.backup_bw.observe(v)
        self.cache.snapshot = snapshot

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
