"""Prometheus metrics of one `hicache-server` (a private registry, on --metrics-port)."""

from __future__ import annotations

from typing import Protocol

from storage_backends.server.store import PageStore, WriteBehind


class _Config(Protocol):
    @property
    def capacity_bytes(self) -> int: ...


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
        self.hits = pc.Counter("hicache_server_hits", "Pages found by get", registry=reg)
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
