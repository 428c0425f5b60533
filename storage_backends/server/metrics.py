"""Prometheus metrics of one `hicache-server` (a private registry, on --metrics-port)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from storage_backends.server.admin import NamespaceCounters, Pins
from storage_backends.server.store import PageStore, WriteBehind


class _Config(Protocol):
    @property
    def capacity_bytes(self) -> int: ...


class TierView(Protocol):
    """What the metrics read of a server's `Tiers` (no import of tiers.py, which counts into
    `Metrics`: no circle)."""

    store: PageStore
    persist: WriteBehind | None
    pins: Pins
    namespaces: NamespaceCounters
    disk_hits: int
    partitions: dict[str, tuple[str, int]]

    def pinned_bytes(self, keys: Any = None) -> int: ...

    def disk_namespaces(self) -> dict[str, tuple[int, int]]: ...

    def namespace_rows(self) -> dict[str, dict[str, int]]: ...


class Observed(Protocol):
    """What the metrics read of a server (no import of the server module: no circle)."""

    @property
    def store(self) -> PageStore: ...

    @property
    def config(self) -> _Config: ...

    @property
    def persist(self) -> WriteBehind | None: ...

    @property
    def connected_clients(self) -> int: ...

    @property
    def tiers(self) -> TierView: ...


class NamespaceCollector:
    """`hicache_server_namespace_pages` / `_bytes` {namespace, tier=memory|disk}, read at each
    scrape (memory: the store's running totals, no walk; disk: the persisted files' index, each
    header read once)."""

    def __init__(self, tiers: TierView) -> None:
        self.tiers = tiers

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        t = self.tiers
        rows = t.namespace_rows()
        pages = GaugeMetricFamily("hicache_server_namespace_pages",
                                  "Pages held per namespace and tier", labels=["namespace", "tier"])
        nbytes = GaugeMetricFamily("hicache_server_namespace_bytes",
                                   "Bytes of pages held per namespace and tier",
                                   labels=["namespace", "tier"])
        for ns, r in sorted(rows.items()):
            for tier, prefix in (("memory", ""), ("disk", "disk_")):
                if tier == "disk" and t.persist is None:
                    continue
                pages.add_metric([ns, tier], r[prefix + "pages"])
                nbytes.add_metric([ns, tier], r[prefix + "bytes"])
        yield pages
        yield nbytes


class PartitionCollector:
    """`hicache_server_partition_bytes` / `_max_bytes` {partition}: each tenant partition's
    bytes in memory and its cap (`max_bytes`, 0: none), read at each scrape from running
    totals. Present only with a tenants file."""

    def __init__(self, tiers: TierView) -> None:
        self.tiers = tiers

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        held = GaugeMetricFamily("hicache_server_partition_bytes",
                                 "Bytes a tenant partition holds in memory", labels=["partition"])
        cap = GaugeMetricFamily("hicache_server_partition_max_bytes",
                                "A tenant partition's cap in memory (max_bytes; 0: none)",
                                labels=["partition"])
        for tag, (name, max_bytes) in sorted(self.tiers.partitions.items(),
                                             key=lambda kv: kv[1][0]):
            held.add_metric([name], self.tiers.store.partition_bytes(tag))
            cap.add_metric([name], max_bytes)
        yield held
        yield cap


class Metrics:
    """Prometheus metrics of one server (a private registry, exported on --metrics-port)."""

    def __init__(self, server: Observed, port: int) -> None:
        import prometheus_client as pc

        reg = pc.CollectorRegistry()
        self.registry = reg
        store = server.store
        pages = pc.Gauge("hicache_server_pages", "Pages held in memory", registry=reg)
        pages.set_function(lambda: store.pages)
        nbytes = pc.Gauge("hicache_server_bytes", "Bytes of pages held in memory", registry=reg)
        nbytes.set_function(lambda: store.bytes)
        cap = pc.Gauge("hicache_server_capacity_bytes", "Memory tier capacity", registry=reg)
        cap.set(server.config.capacity_bytes)
        clients = pc.Gauge("hicache_server_connected_clients", "Connected clients", registry=reg)
        clients.set_function(lambda: server.connected_clients)
        tiers = server.tiers
        gauges = (
            ("hicache_server_pinned_pages", "Pages pinned (hicache-admin pin)",
             lambda: len(tiers.pins)),
            ("hicache_server_pinned_bytes", "Bytes of the pinned pages in memory",
             tiers.pinned_bytes),
            ("hicache_server_pin_limit_bytes", "Most bytes pins may hold (--pin-share)",
             lambda: tiers.pins.limit_bytes),
            ("hicache_server_pins_expired", "Pins whose lease (--ttl) ended, since start",
             lambda: tiers.pins.expired),
            ("hicache_server_read_leases", "Read leases held on records read in place",
             lambda: store.leases.counters["read_leases"]),
            ("hicache_server_disk_hits", "Pages found on disk (not in memory) by get",
             lambda: tiers.disk_hits),
            ("hicache_server_quota_evictions", "Pages a tenant partition evicted of its own "
             "to stay under its max_bytes, since start", lambda: store.counters.quota_evictions),
            ("hicache_server_quota_rejected", "Pages refused: larger than their partition's "
             "max_bytes, or only its kept pages could make room", lambda: store.counters.quota_rejected),
        )
        for name, doc, fn in gauges:
            pc.Gauge(name, doc, registry=reg).set_function(fn)
        reg.register(NamespaceCollector(tiers))
        reg.register(PartitionCollector(tiers))
        self.hits = pc.Counter("hicache_server_hits", "Pages found by get (memory or disk)",
                               registry=reg)
        self.misses = pc.Counter("hicache_server_misses", "Pages get did not find", registry=reg)
        self.evictions = pc.Counter(
            "hicache_server_evictions", "Pages evicted from memory (LRU)", registry=reg
        )
        self.errors = pc.Counter(
            "hicache_server_errors", "Error replies by code", ["code"], registry=reg
        )
        self.page_bytes = pc.Counter(
            "hicache_server_page_bytes",
            "Page bytes received (dir=in: set) and sent (dir=out: get) per data path "
            "(path=tcp: ZeroMQ frames, path=shm: a client's shared-memory region, path=store: "
            "read in place from the server's shared-memory store)",
            ["path", "dir"],
            registry=reg,
        )
        self.latency = pc.Histogram(
            "hicache_server_request_seconds",
            "Request handling latency by op",
            ["op"],
            buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1),
            registry=reg,
        )
        if server.persist is not None:
            wb = server.persist
            pend = pc.Gauge(
                "hicache_server_persist_pending", "Pages waiting to be persisted", registry=reg
            )
            pend.set_function(lambda: wb.pending)
            self.persist_dropped = pc.Counter(
                "hicache_server_persist_dropped",
                "Pages not persisted because the write-behind queue was full",
                registry=reg,
            )
        self.httpd, self.thread = pc.start_http_server(port, addr="127.0.0.1", registry=reg)
