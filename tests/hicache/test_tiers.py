"""Exact tier behaviour: write policies, re-attach, load-back, prefetch policies."""

from __future__ import annotations

import pytest
import torch

from hicache_client.errors import ConfigError
from tests.hicache.factories import run_request, sim_cache

SEQ = list(range(100, 108))  # 4 pages of 2


def host_nodes(cache):
    return [n for n in cache.tree.nodes() if n.host_value is not None]


def test_write_through_backs_up_on_insert():
    c = sim_cache(page_size=2, write_policy="write_through")
    run_request(c, SEQ)
    (node,) = list(c.tree.nodes())
    assert node.value is not None and len(node.host_value) == 4
    assert c.stats.backup_tokens == 8
    c.check_integrity(0)


def test_write_through_selective_backs_up_on_the_threshold_th_use():
    # As in SGLang: the insert that creates a node is its first use, so with threshold 2 the
    # second request's admission backs it up.
    c = sim_cache(page_size=2, write_policy="write_through_selective", write_through_threshold=2)
    run_request(c, SEQ + [0])  # admitted with nothing cached; its insert creates the node
    (node,) = list(c.tree.nodes())
    assert (node.hit_count, host_nodes(c), c.stats.backup_tokens) == (1, [], 0)
    run_request(c, SEQ + [0])  # second use: threshold reached
    assert node.hit_count == 2
    assert [len(n.host_value) for n in host_nodes(c)] == [4]
    assert c.stats.backup_tokens == 8
    c.check_integrity(0)


def test_write_through_selective_threshold_one_backs_up_at_insert():
    c = sim_cache(page_size=2, write_policy="write_through_selective", write_through_threshold=1)
    run_request(c, SEQ + [0])
    assert [len(n.host_value) for n in host_nodes(c)] == [4]
    assert c.stats.backup_tokens == 8
    c.check_integrity(0)


def test_write_back_backs_up_only_on_eviction():
    c = sim_cache(page_size=2, write_policy="write_back")
    run_request(c, SEQ + [0])
    run_request(c, SEQ + [0])
    assert host_nodes(c) == [] and c.stats.backup_tokens == 0
    assert c.evict(8) == 8
    m = c.match_prefix(SEQ)
    assert (m.device_tokens, m.host_tokens) == (0, 8)
    assert c.stats.backup_tokens == 8
    c.check_integrity(0)


def test_without_backup_eviction_deletes():
    c = sim_cache(page_size=2, write_policy="write_through_selective")
    run_request(c, SEQ)
    assert c.evict(8) == 8
    assert list(c.tree.nodes()) == []
    c.check_integrity(0)


def test_recompute_reattaches_device_pages_to_host_only_node():
    c = sim_cache(page_size=2)
    run_request(c, SEQ)
    c.evict(8)
    (node,) = list(c.tree.nodes())
    host = list(node.host_value)
    assert node.value is None
    pages = c.alloc_device(4)
    res = c.insert(SEQ, pages)
    assert node.value == pages and node.host_value == host
    assert res.device_pages == pages and res.duplicate_pages == [] and res.new_tokens == 8
    c.check_integrity(0)


def test_insert_frees_duplicates_and_returns_tree_pages():
    c = sim_cache(page_size=2)
    first, _ = run_request(c, SEQ)
    mine = c.alloc_device(4)
    res = c.insert(SEQ, mine)
    assert res.device_pages == first
    assert res.duplicate_pages == mine and res.new_tokens == 0
    assert all(not c.device_alloc.is_used(p) for p in mine)
    c.check_integrity(0)


def test_load_back_is_all_or_nothing():
    c = sim_cache(page_size=2, device_pages=6, host_pages=12)
    run_request(c, SEQ)  # 4 pages
    c.evict(8)  # now host only
    # Hold 3 of 6 device pages outside the tree: only 3 free, the chain needs 4.
    held = c.alloc_device(3)
    acq = c.acquire(SEQ + [0])
    assert acq.cached_tokens == 0 and acq.host_hit_tokens == 0
    assert c.stats.load_back_skipped_tokens == 8
    assert c.match_prefix(SEQ).host_tokens == 8  # nothing half-loaded
    c.release(acq.node)
    c.check_integrity(3)
    c.free_device(held)
    acq = c.acquire(SEQ + [0])
    assert (acq.cached_tokens, acq.host_hit_tokens) == (8, 8)
    c.release(acq.node)
    c.check_integrity(0)


def test_load_back_copies_the_host_kv_to_the_device():
    """Real pools: the KV a request loads back is the KV that was computed, byte for byte,
    after the device pool was overwritten."""
    from tests.hicache.factories import tensor_cache

    c = tensor_cache(page_size=4, device_pages=8, host_pages=16, storage=False, synchronous=True)
    tokens = list(range(40, 56))  # 4 pages
    pages, _ = run_request(c, tokens, fill=True)
    pool = c.device_pool
    computed = pool.kv[:, :, pool.slots(pages)].clone()
    assert c.evict(16) == 16  # host only now
    pool.kv.fill_(7.0)  # whatever the device pages held is gone
    acq = c.acquire(tokens + [0])
    assert (acq.cached_tokens, acq.host_hit_tokens) == (16, 16)
    assert torch.equal(pool.kv[:, :, pool.slots(acq.device_pages)], computed)
    c.release(acq.node)
    c.check_integrity(0)
    c.close()


def test_load_back_threshold_skips_short_host_hits():
    c = sim_cache(page_size=2, load_back_threshold=10)
    run_request(c, SEQ)
    c.evict(8)
    acq = c.acquire(SEQ + [0])
    assert acq.cached_tokens == 0
    c.release(acq.node)


def test_per_tier_hit_accounting():
    c = sim_cache(page_size=2, device_pages=8, host_pages=16, storage_pages=None)
    run_request(c, SEQ, rid="a")  # miss: computes 8
    _, cached = run_request(c, SEQ + [0, 0], rid="b")  # device hit
    assert cached == 8
    c.evict(100)  # all to host
    run_request(c, SEQ + [0, 0], rid="c")  # host hit 10 (b cached the [0, 0] page too)
    c.evict(100)
    c.evict_host(100)  # everything only in L3 now
    run_request(c, SEQ + [0, 0, 1], rid="d")  # storage hit of 10 tokens
    s = c.stats
    assert (s.requests, s.device_hit_tokens, s.host_hit_tokens, s.storage_hit_tokens) == (4, 8, 10, 10)
    assert (s.device_hit_requests, s.host_hit_requests, s.storage_hit_requests) == (1, 1, 1)
    assert s.input_tokens == 8 + 10 + 10 + 11
    c.check_integrity(0)


def test_prefetch_threshold_and_missing_pages():
    c = sim_cache(page_size=2, storage_pages=None, prefetch_threshold=6)
    run_request(c, SEQ)  # starts a prefetch of its 4 pages; L3 has none of them
    c.evict(100)
    c.evict_host(100)
    assert c.prefetch("x", SEQ[:4]) == 0  # 4 tokens < threshold
    # Asks L3 for the 6 uncached pages; host pages are reserved for the 4 leading ones it has.
    assert c.prefetch("y", SEQ + [7, 7, 7, 7]) == 12
    assert c.prefetch_progress("y") == (4, 4)
    acq = c.acquire(SEQ + [7, 7, 7, 7], request_id="y")
    assert acq.storage_hit_tokens == 8
    c.release(acq.node)
    s = c.stats
    # Skipped: the first request (L3 had nothing) and "x".
    assert (s.prefetch_started, s.prefetch_skipped, s.prefetch_pages) == (1, 2, 4)
    assert c.usage()["host_inflight_pages"] == 0
    c.check_integrity(0)


def test_prefetch_takes_at_most_its_share_of_the_host_pool():
    c = sim_cache(page_size=2, device_pages=16, host_pages=8, storage_pages=None,
                  prefetch_max_host_share=0.5)
    run_request(c, SEQ)
    c.evict(100)
    c.evict_host(100)
    assert c.prefetch("a", SEQ + [7, 7]) == 8  # 5 uncached pages, 4 allowed (half of 8)
    assert c.prefetch("b", SEQ) == 0  # the share is used up
    assert c.prefetcher.held == 4
    assert c.stats.prefetch_skipped == 2  # "b", and the first request (L3 had nothing)
    acq = c.acquire(SEQ + [7, 7], request_id="a")
    assert acq.storage_hit_tokens == 8
    c.release(acq.node)
    assert c.prefetcher.held == 0
    c.evict(100)
    c.evict_host(100)
    assert c.prefetch("b", SEQ) == 8  # the share is free again
    c.cancel_prefetch("b")
    c.check_integrity(0)


def test_pending_prefetch_pins_host_copies_not_device_ones():
    c = sim_cache(page_size=2, device_pages=8, host_pages=16, storage_pages=None)
    run_request(c, SEQ + [5, 5])  # 5 pages, backed up to host and L3
    c.evict(100)
    c.evict_host(100)
    run_request(c, SEQ)  # the first 4 pages again: device + host
    (head,) = list(c.tree.nodes())
    assert c.prefetch("r", SEQ + [5, 5]) == 2  # the 5th page, anchored on the cached head
    assert (head.lock_ref, head.host_ref) == (0, 1)
    assert c.evictable_device_tokens() == 8  # the head stays evictable on the device
    assert c.evict(100) == 8
    assert head.value is None and head.host_value is not None and not head.removed
    c.check_integrity(0)
    acq = c.acquire(SEQ + [5, 5], request_id="r")
    assert (acq.host_hit_tokens, acq.storage_hit_tokens) == (8, 2)
    c.release(acq.node)
    assert head.host_ref == 0
    c.check_integrity(0)


def test_prefetch_whose_device_only_prefix_was_evicted_takes_nothing():
    c = sim_cache(page_size=2, device_pages=8, host_pages=16, storage_pages=None,
                  write_policy="write_through_selective", write_through_threshold=2)
    run_request(c, SEQ + [5, 5])
    run_request(c, SEQ + [5, 5])  # second use: backed up to host, then to L3
    c.evict(100)
    c.evict_host(100)
    c.insert(SEQ, c.alloc_device(4))  # the head again, on the device only (its first use)
    (head,) = list(c.tree.nodes())
    assert c.prefetch("r", SEQ + [5, 5]) == 2
    assert (head.host_value, head.lock_ref, head.host_ref) == (None, 0, 0)
    c.evict(100)  # no host copy: the head leaves the tree, the prefetch cannot attach
    assert list(c.tree.nodes()) == []
    acq = c.acquire(SEQ + [5, 5], request_id="r")
    assert (acq.cached_tokens, acq.storage_hit_tokens) == (0, 0)
    c.release(acq.node)
    assert c.stats.prefetch_revoked_pages == 1
    assert c.usage()["host_inflight_pages"] == 0
    c.check_integrity(0)


def test_cancelled_prefetch_frees_host_pages():
    c = sim_cache(page_size=2, storage_pages=None)
    run_request(c, SEQ)
    c.evict(100)
    c.evict_host(100)
    free = c.host_alloc.num_free
    assert c.prefetch("x", SEQ) == 8
    assert c.host_alloc.num_free == free - 4
    c.check_integrity(0)
    c.cancel_prefetch("x")
    assert c.host_alloc.num_free == free
    c.check_integrity(0)


def test_extra_key_isolates():
    c = sim_cache(page_size=2)
    run_request(c, SEQ, extra_key="tenant-a")
    assert c.match_prefix(SEQ, extra_key="tenant-b").device_tokens == 0
    assert c.match_prefix(SEQ).device_tokens == 0
    assert c.match_prefix(SEQ, extra_key="tenant-a").device_tokens == 8


def test_storage_needs_host_tier():
    with pytest.raises(ConfigError):
        sim_cache(host_pages=0, storage_pages=None)


def test_reset_drops_everything():
    c = sim_cache(page_size=2)
    run_request(c, SEQ)
    c.reset()
    assert list(c.tree.nodes()) == []
    assert c.device_alloc.num_free == 16 and c.host_alloc.num_free == 32
    c.check_integrity(0)


def test_clear_storage_empties_l3():
    from tests.hicache.factories import tensor_cache

    c = tensor_cache(synchronous=True)
    pages = c.alloc_device(4)
    c.insert(list(range(16)), pages)
    keys = c.storage_keys(next(iter(c.tree.nodes())))
    assert c.storage.batch_exists(keys) == 4
    c.clear_storage()
    assert c.storage.batch_exists(keys) == 0
    c.check_integrity(0)
