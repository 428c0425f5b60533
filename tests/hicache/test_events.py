"""Cache events: a sink that rebuilds per-tier page sets from the events always equals the
cache's own state (device and host from the tree, storage from the L3 it wrote)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent, block_hash
from tests.hicache.factories import sim_cache
from tests.hicache.test_randomized import start_request


class Rebuild:
    """An event consumer: the set of block hashes it believes each tier holds."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[int]] = {"device": set(), "host": set(), "storage": set()}
        self.events: list[CacheEvent] = []

    def __call__(self, ev: CacheEvent) -> None:
        self.events.append(ev)
        if isinstance(ev, BlockStored):
            assert len(ev.token_ids) == len(ev.block_hashes) * ev.page_size
            self.tiers[ev.tier].update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            self.tiers[ev.tier].difference_update(ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            for t in [ev.tier] if ev.tier else list(self.tiers):
                self.tiers[t].clear()


def truth(cache) -> dict[str, set[int]]:
    dev: set[int] = set()
    host: set[int] = set()
    for n in cache.tree.nodes():
        hashes = {block_hash(d) for d in cache.chain.digests(n)}
        if n.value is not None:
            dev |= hashes
        if n.host_value is not None:
            host |= hashes
    stored = {block_hash(bytes.fromhex(k)) for k in cache.sim_storage.keys}
    return {"device": dev, "host": host, "storage": stored}


op = st.one_of(
    st.tuples(st.just("start"), st.integers(0, 7), st.integers(1, 5)),
    st.tuples(st.just("finish"), st.integers(0, 10), st.just(0)),
    st.tuples(st.just("evict"), st.integers(1, 6), st.just(0)),
    st.tuples(st.just("evict_host"), st.integers(1, 6), st.just(0)),
    st.tuples(st.just("reset"), st.just(0), st.just(0)),
)


@pytest.mark.parametrize("host_memory_mode", ["full", "buffer_only"])
@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective",
                                          "write_back"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=40), page_size=st.sampled_from([1, 4]))
def test_events_rebuild_every_tier_exactly(write_policy, host_memory_mode, ops, page_size):
    sink = Rebuild()
    cache = sim_cache(page_size=page_size, device_pages=12, host_pages=10, storage_pages=None,
                      write_policy=write_policy, host_memory_mode=host_memory_mode)
    cache.set_event_sink(sink)
    running: list[tuple] = []
    rid = 0
    for kind, a, b in ops:
        if kind == "start":
            rid += 1
            req = start_request(cache, rid, a, b, page_size, wait=False)
            if req is not None:
                running.append(req)
        elif kind == "finish" and running:
            tokens, pages, node, _ = running.pop(a % len(running))
            cache.insert(tokens, pages)
            cache.release(node)
        elif kind == "evict":
            cache.evict(a * page_size)
        elif kind == "evict_host":
            cache.evict_host(a * page_size)
        elif kind == "reset" and not running:
            cache.reset()
        cache.poll()
        assert sink.tiers == truth(cache), kind
    assert all(isinstance(e, (BlockStored, BlockRemoved, AllBlocksCleared)) for e in sink.events)


def test_event_contents_of_one_request():
    sink = Rebuild()
    c = sim_cache(page_size=2, storage_pages=None)
    c.set_event_sink(sink)
    tokens = [1, 2, 3, 4, 5, 6]
    pages = c.alloc_device(3)
    c.insert(tokens, pages)
    digests = c.chain.digests(next(iter(c.tree.nodes())))
    hashes = tuple(block_hash(d) for d in digests)
    assert sink.events == [
        BlockStored(hashes, None, tuple(tokens), 2, "device"),
        BlockStored(hashes, None, tuple(tokens), 2, "host"),
        BlockStored(hashes, None, tuple(tokens), 2, "storage"),
    ]
    c.evict(6)  # backed up: the device copy goes, the host copy stays
    assert sink.events[3:] == [BlockRemoved(hashes, "device")]
    c.reset()
    assert sink.events[4:] == [AllBlocksCleared("device"), AllBlocksCleared("host")]
    c.set_event_sink(None)
    c.insert(tokens, c.alloc_device(3))
    assert len(sink.events) == 6


def test_no_sink_computes_no_digest():
    c = sim_cache(page_size=2)  # no L3: digests are only needed for events
    c.insert([1, 2, 3, 4], c.alloc_device(2))
    assert [n.page_keys for n in c.tree.nodes()] == [None]
