"""`PageStore` per tenant partition: its running totals per (partition, namespace), what a
metrics scrape, the admin's `stats` and a tenant's `stats` read instead of walking every page
(after every kind of change they equal a walk of the map made from the records' own headers);
and each partition's cap (`max_bytes`), kept by evicting that partition's own pages."""

from __future__ import annotations

import random

from hicache_client.codec import PageCodec
from storage_backends.server.admin import Pins
from storage_backends.server.arena import BLOCK, Arena
from storage_backends.server.store import _NS_END, PageStore, namespace_of, nbytes

NS_A, NS_B = bytes(range(32)), bytes(range(1, 33))
TAG_A, TAG_B = "a" * 16, "b" * 16


def _record(ns: bytes, key: str, tokens: int) -> bytearray:
    c = PageCodec(namespace=ns, dtype="uint8", shape=(tokens * 64,), layout="raw",
                  tokens_per_page=tokens, itemsize=1)
    return c.encode(key, random.Random(key).randbytes(c.payload_bytes))


def _walk(store: PageStore, partition_chars: int) -> dict[tuple[str, str], tuple[int, int]]:
    """The totals recomputed from each held record's header (the slow, obvious way)."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for key in store.lru_order():
        (v,) = store.peek([key])
        assert v is not None
        ns = namespace_of(store.view(v)[:_NS_END]) or "-"
        p, b = out.get((key[:partition_chars], ns), (0, 0))
        out[(key[:partition_chars], ns)] = (p + 1, b + nbytes(v))
    return out


def _check(store: PageStore, partition_chars: int) -> dict[tuple[str, str], tuple[int, int]]:
    walk = _walk(store, partition_chars)
    by_ns: dict[str, tuple[int, int]] = {}
    for (_, ns), (p, b) in walk.items():
        p0, b0 = by_ns.get(ns, (0, 0))
        by_ns[ns] = (p0 + p, b0 + b)
    assert store.namespace_totals() == by_ns
    for part in {part for part, _ in walk}:
        assert store.namespace_totals(partition=part) == {
            ns: t for (pt, ns), t in walk.items() if pt == part}
    assert sum(p for p, _ in by_ns.values()) == store.pages
    assert sum(b for _, b in by_ns.values()) == store.bytes
    return walk


def test_totals_follow_every_change_with_tenant_partitions() -> None:
    rec = len(_record(NS_A, "x", 16))
    store = PageStore(6 * rec, partition_chars=16)  # room for six records
    keys = [f"{tag}{i:064x}" for i in range(4) for tag in (TAG_A, TAG_B)]
    for k in keys[:6]:
        assert store.put(k, _record(NS_A if k.startswith(TAG_A) else NS_B, k, 16))[0]
    assert _check(store, 16) == {(TAG_A, NS_A.hex()): (3, 3 * rec),
                                 (TAG_B, NS_B.hex()): (3, 3 * rec)}
    # Two more evict the two least recently used (keys[0], keys[1]).
    for k in keys[6:]:
        ok, evicted = store.put(k, _record(NS_A if k.startswith(TAG_A) else NS_B, k, 16))
        assert ok
    assert set(store.lru_order()) == set(keys[2:])
    _check(store, 16)
    # A replacement under the same key, by a record of the other namespace and another size.
    store.put(keys[2], _record(NS_B, keys[2], 8))
    walk = _check(store, 16)
    assert walk[(TAG_A, NS_B.hex())] == (1, len(_record(NS_B, "y", 8)))
    # Bytes that are not a record are counted under "-".
    store.put(TAG_B + "f" * 64, b"not a record")
    assert store.namespace_totals(partition=TAG_B)["-"] == (1, len(b"not a record"))
    _check(store, 16)
    # A page larger than the whole capacity is refused and changes nothing.
    before = store.namespace_totals()
    assert store.put(TAG_A + "e" * 64, bytes(7 * rec))[0] is False
    assert store.namespace_totals() == before
    assert store.delete([keys[3], "absent"]) == 1
    _check(store, 16)
    assert store.clear_namespace(NS_B, prefix=TAG_A) == 1  # keys[2], rewritten under NS_B
    assert store.namespaces_of([keys[2], keys[4]]) == [None, NS_A.hex()]
    _check(store, 16)
    assert store.clear_namespace(None, prefix=TAG_B) == 3
    assert store.namespace_totals(partition=TAG_B) == {}
    _check(store, 16)
    store.clear()
    assert store.namespace_totals() == {} and store.lru_order() == []


def test_totals_of_arena_records_are_read_once_at_store_time(tmp_path) -> None:  # noqa: ANN001
    arena = Arena(64 * BLOCK, str(tmp_path))
    try:
        store = PageStore(0, arena)
        key = "c" * 64
        rec = _record(NS_A, key, 16)
        assert store.put(key, memoryview(rec), to_arena=True)[0]
        (slot,) = store.peek([key])
        assert not isinstance(slot, (bytes, bytearray, memoryview))  # it lives in the arena
        assert store.namespace_totals() == {NS_A.hex(): (1, len(rec))}
        # A same-host client rewriting the record's header in place does not move its count.
        store.view(slot)[8:40] = NS_B
        assert store.namespace_totals() == {NS_A.hex(): (1, len(rec))}
        assert store.delete([key]) == 1
        assert store.namespace_totals() == {}
    finally:
        arena.close()


def test_a_partition_cap_evicts_its_own_least_recently_used_pages() -> None:
    rec = len(_record(NS_A, "x", 16))
    store = PageStore(0, partition_chars=16)  # no server capacity: only the cap evicts
    store.quotas = {TAG_A: 3 * rec}
    a = [f"{TAG_A}{i:064x}" for i in range(6)]
    b = [f"{TAG_B}{i:064x}" for i in range(4)]
    for k in b[:2] + a[:3]:
        assert store.put(k, _record(NS_A, k, 16)) == (True, [])
    assert store.get([a[0]])[0] is not None  # a[0] is now A's most recently used
    assert store.put(a[3], _record(NS_A, a[3], 16)) == (True, [a[1]])
    assert store.put(a[4], _record(NS_A, a[4], 16)) == (True, [a[2]])
    assert store.put(b[2], _record(NS_B, b[2], 16)) == (True, [])  # B has no cap
    assert set(store.lru_order()) == {b[0], b[1], b[2], a[0], a[3], a[4]}
    assert store.partition_bytes(TAG_A) == 3 * rec and store.partition_bytes(TAG_B) == 3 * rec
    # A replacement of a page of A's is no growth: nothing evicted.
    assert store.put(a[4], _record(NS_A, a[4], 16)) == (True, [])
    # Pinned pages are never evicted: with all three of A's pinned, A's next page is refused.
    store.pins = Pins(1 << 30)
    store.pins.pin([a[0], a[3], a[4]], [rec] * 3, 0.0, lambda keys: 0)
    assert store.put(a[5], _record(NS_A, a[5], 16)) == (False, [])
    assert store.counters.quota_rejected == 1 and store.counters.quota_evictions == 2
    # A page larger than the cap alone is refused too.
    store.pins = None
    assert store.put(a[5], bytes(4 * rec)) == (False, [])
    assert set(store.lru_order()) == {b[0], b[1], b[2], a[0], a[3], a[4]}
    _check(store, 16)


def test_caps_that_sum_below_the_capacity_are_reservations() -> None:
    """Issue 46: an uncapped tenant's flood evicted all of a capped tenant's pages while it
    was under its cap; with the caps summing below --capacity, a cap is a reservation."""
    rec = len(_record(NS_A, "x", 16))
    store = PageStore(8 * rec, partition_chars=16)
    store.quotas = {TAG_A: 3 * rec}  # 3 of the 8 reserved for A; B (uncapped) has 5
    a = [f"{TAG_A}{i:064x}" for i in range(4)]
    b = [f"{TAG_B}{i:064x}" for i in range(40)]
    for k in a[:3]:
        assert store.put(k, _record(NS_A, k, 16)) == (True, [])
    for k in b:  # B's flood: it evicts only its own pages
        stored, evicted = store.put(k, _record(NS_B, k, 16))
        assert stored and all(e.startswith(TAG_B) for e in evicted)
    assert store.partition_bytes(TAG_A) == 3 * rec and store.partition_bytes(TAG_B) == 5 * rec
    assert all(v is not None for v in store.peek(a[:3]))
    # A past its cap evicts its own least recently used page, as before.
    assert store.put(a[3], _record(NS_A, a[3], 16)) == (True, [a[0]])
    # Caps summing past the capacity reserve nothing: the shared LRU decides.
    store.quotas = {TAG_A: 3 * rec, TAG_B: 6 * rec}
    stored, evicted = store.put(b[0], _record(NS_B, b[0], 16))
    assert stored and evicted == [a[1]]
    _check(store, 16)
