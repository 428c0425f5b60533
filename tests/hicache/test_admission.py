"""L3 admission (always / reuse:N / frequency) and the per-request hints (skip_cache_write,
retention_seconds, priority): which pages reach which tier, exactly."""

from __future__ import annotations

import pytest

from hicache.admission import CacheHints, Declined, make_admission
from hicache.config import HiCacheConfig
from hicache.hiradix import HiRadixCache
from hicache.simulation import SimStorage, simulate_request
from hicache_client.errors import ConfigError

PS = 4


def cache(clock=None, storage=True, device_pages=64, host_pages=64, **cfg) -> HiRadixCache:
    cfg.setdefault("prefetch_threshold", 0)
    cfg.setdefault("load_back_threshold", 0)
    config = HiCacheConfig(page_size=PS, simulated=True, **cfg)
    return HiRadixCache(config, num_device_pages=device_pages, num_host_pages=host_pages,
                        sim_storage=SimStorage(None) if storage else None, clock=clock)


def prompt(base: int, pages: int = 4) -> list[int]:
    """`pages` full pages of distinct tokens and one more (the last prompt token is computed)."""
    return [base + i for i in range(pages * PS)] + [base + 999]


def in_l3(c: HiRadixCache, tokens: list[int]) -> int:
    """Leading pages of `tokens` in the simulated L3."""
    nodes = c.tree.match_split(tuple(tokens)).copy()
    keys = [k for x in nodes for k in c.storage_keys(x)]
    assert c.sim_storage is not None
    return c.sim_storage.exists(keys)


def on_host(c: HiRadixCache, tokens: list[int]) -> int:
    return sum(x.num_pages for x in c.tree.match(tuple(tokens)).nodes if x.host_value is not None)


def on_device(c: HiRadixCache, tokens: list[int]) -> int:
    return sum(x.num_pages for x in c.tree.match(tuple(tokens)).nodes if x.value is not None)


# -- admission -----------------------------------------------------------------------------------


def test_specs():
    assert make_admission("always").spec() == "always"
    assert make_admission("reuse:2").spec() == "reuse:2"
    assert make_admission("frequency").spec() == "frequency:1000"
    assert make_admission("frequency:5").spec() == "frequency:5"
    for bad in ("reuse", "reuse:0", "reuse:x", "sometimes", "always:1", "frequency:0"):
        with pytest.raises(ConfigError, match="storage admission"):
            make_admission(bad)
    with pytest.raises(ConfigError):
        HiCacheConfig(storage_admission="reuse:-1")


def test_always_writes_at_first_sight():
    c = cache()
    p = prompt(0)
    simulate_request(c, "a", p)
    assert in_l3(c, p) == 4 and c.stats.storage_backup_pages == 4
    assert c.stats.storage_declined_pages == 0


def test_reuse_2_reaches_l3_after_the_third_request():
    c = cache(storage_admission="reuse:2")
    p = prompt(0)
    seen = []
    for i in range(4):
        simulate_request(c, str(i), p)
        seen.append((in_l3(c, p), on_host(c, p), c.stats.storage_backup_pages))
    # Sent once, then twice more: on host from the first, in L3 after the third, written once.
    assert seen == [(0, 4, 0), (0, 4, 0), (4, 4, 4), (4, 4, 4)]
    s = c.stats
    # Declined at the first backup and again at the second request's hit.
    assert s.storage_declined_pages == 8
    assert not any(x.declined for x in c.tree.nodes())


def test_reuse_counts_survive_the_page_leaving_the_tree():
    """A prompt evicted from device and host, recomputed, still counts its earlier uses; the
    recomputed declined pages are the hits L3 would have served."""
    c = cache(storage_admission="reuse:1", device_pages=4, host_pages=4)
    p, q = prompt(0), prompt(5000)
    simulate_request(c, "a", p)
    assert in_l3(c, p) == 0 and c.stats.storage_declined_pages == 4
    simulate_request(c, "b", q)  # pushes p out of device and host
    assert on_host(c, p) == 0 and on_device(c, p) == 0
    simulate_request(c, "c", p)  # recomputed: its second use, admitted at the backup
    s = c.stats
    assert s.storage_declined_rehit_pages == 4
    assert in_l3(c, p) == 4


def test_frequency_decays():
    c = cache(storage_admission="frequency:3")
    p, q = prompt(0), prompt(5000)
    simulate_request(c, "p1", p)
    simulate_request(c, "p2", p)  # count 2 within a half-life: written
    assert in_l3(c, p) == 4
    simulate_request(c, "q1", q)
    for i in range(3):  # three requests go by: q's count of 1 halves
        simulate_request(c, f"x{i}", prompt(10_000 * (i + 2)))
    simulate_request(c, "q2", q)  # 2 x 0.5 = 1: not yet
    assert in_l3(c, q) == 0
    simulate_request(c, "q3", q)  # 2 x 1 = 2
    assert in_l3(c, q) == 4


def test_declined_sketch_is_bounded():
    d = Declined(capacity=3)
    keys = [bytes([i]) * 32 for i in range(5)]
    d.add(keys)
    assert len(d.ids) == 3 and keys[0] not in d and keys[4] in d
    assert d.count(keys) == 3
    d.discard(keys[4:])
    assert d.count(keys) == 2


# -- skip_cache_write ----------------------------------------------------------------------------


def test_skip_cache_write_stays_on_device_and_goes_first():
    c = cache(device_pages=6, host_pages=16)
    a, b, d, e = prompt(0, 2), prompt(1000, 2), prompt(2000, 2), prompt(3000, 2)
    simulate_request(c, "a", a)
    simulate_request(c, "b", b, hints=CacheHints(skip_cache_write=True))
    assert on_device(c, b) == 2 and on_host(c, b) == 0 and in_l3(c, b) == 0
    assert c.stats.skip_write_pages == 2
    simulate_request(c, "d", d)  # the device is full now
    simulate_request(c, "e", e)  # evicts b (skip first), not a (the oldest)
    assert c.tree.match(tuple(b)).matched_tokens == 0  # gone from every tier
    assert on_device(c, a) == 2 and in_l3(c, a) == 2
    assert in_l3(c, b) == 0 and c.stats.storage_backup_pages == 6


def test_skip_cache_write_pages_kept_once_a_plain_request_uses_them():
    c = cache()
    b = prompt(0, 3)
    simulate_request(c, "b", b, hints=CacheHints(skip_cache_write=True))
    assert on_host(c, b) == 0
    simulate_request(c, "b2", b)
    assert on_host(c, b) == 3 and in_l3(c, b) == 3
    assert not any(x.no_write for x in c.tree.nodes())


def test_skip_cache_write_extension_of_a_cached_prefix():
    c = cache()
    base = prompt(0, 2)[:-1]
    simulate_request(c, "a", base + [7])
    ext = base + list(range(500, 500 + 2 * PS)) + [7]
    simulate_request(c, "b", ext, hints=CacheHints(skip_cache_write=True))
    assert on_host(c, ext) == 2 and in_l3(c, ext) == 2  # the shared prefix only
    assert on_device(c, ext) == 4


# -- retention -----------------------------------------------------------------------------------


def test_retention_pins_until_its_time_and_is_counted():
    now = [100.0]
    c = cache(clock=lambda: now[0], storage=False, device_pages=4, host_pages=0)
    a, b, d = prompt(0, 2), prompt(1000, 2), prompt(2000, 2)
    simulate_request(c, "a", a, hints=CacheHints(retention_seconds=30))
    assert {x.retain_until for x in c.tree.nodes()} == {130.0}
    simulate_request(c, "b", b)
    simulate_request(c, "d", d)  # evicts b, not the older but pinned a
    assert on_device(c, a) == 2 and on_device(c, b) == 0
    now[0] = 130.0
    simulate_request(c, "b2", b)  # the pin ran out: a (least recent) goes now
    assert on_device(c, a) == 0 and on_device(c, b) == 2
    s = c.stats
    assert (s.retention_requests, s.retention_clamped, s.retention_expired) == (1, 0, 1)


def test_retention_never_outlives_its_bound():
    now = [0.0]
    c = cache(clock=lambda: now[0], max_retention_seconds=60)
    a = prompt(0, 2)
    simulate_request(c, "a", a, hints=CacheHints(retention_seconds=10**9))
    assert {x.retain_until for x in c.tree.nodes()} == {60.0}
    assert c.stats.retention_clamped == 1
    off = cache(clock=lambda: now[0], max_retention_seconds=0)
    simulate_request(off, "a", a, hints=CacheHints(retention_seconds=10))
    assert {x.retain_until for x in off.tree.nodes()} == {0.0}
    assert off.stats.retention_requests == 0


def test_retention_is_a_soft_pin():
    """Pinned pages are evicted when nothing else is left, rather than refusing a request."""
    now = [0.0]
    c = cache(clock=lambda: now[0], storage=False, device_pages=4, host_pages=0)
    a, b = prompt(0, 2), prompt(1000, 4)
    simulate_request(c, "a", a, hints=CacheHints(retention_seconds=30))
    r = simulate_request(c, "b", b)
    assert r.computed_tokens == len(b) and on_device(c, b) == 4 and on_device(c, a) == 0


def test_a_split_pin_expires_whole():
    now = [0.0]
    c = cache(clock=lambda: now[0], storage=False, device_pages=16, host_pages=0)
    a = prompt(0, 4)
    simulate_request(c, "a", a, hints=CacheHints(retention_seconds=5))
    simulate_request(c, "half", a[: 2 * PS] + [1, 2, 3, 4, 5])  # splits the pinned node
    assert len(list(c.tree.nodes())) == 3
    now[0] = 6.0
    c.evict(0)
    assert all(x.retain_until == 0 for x in c.tree.nodes())


# -- priority ------------------------------------------------------------------------------------


def test_priority_policy_reads_the_request_priority():
    c = cache(storage=False, device_pages=4, host_pages=0, eviction_policy="priority")
    lo, hi, new = prompt(0, 2), prompt(1000, 2), prompt(2000, 2)
    simulate_request(c, "hi", hi, hints=CacheHints(priority=5))
    simulate_request(c, "lo", lo, hints=CacheHints(priority=1))
    simulate_request(c, "new", new)  # evicts lo (lower priority), though hi is older
    assert on_device(c, hi) == 2 and on_device(c, lo) == 0


def test_hints_from_any():
    assert CacheHints.from_any(None) == CacheHints()
    h = CacheHints.from_any({"skip_cache_write": True, "retention_seconds": 5, "priority": 2})
    assert h == CacheHints(True, 5.0, 2) and h.as_dict() == {
        "skip_cache_write": True, "retention_seconds": 5.0, "priority": 2}
    for bad, field in (({"skip_cache_write": 1}, "skip_cache_write"),
                       ({"retention_seconds": "5"}, "retention_seconds"),
                       ({"retention_seconds": True}, "retention_seconds"),
                       ({"priority": 1.5}, "priority"), ({"ttl": 1}, "ttl")):
        with pytest.raises(TypeError, match=field):
            CacheHints.from_any(bad)
    with pytest.raises(ValueError, match="retention_seconds"):
        CacheHints.from_any({"retention_seconds": -1})
