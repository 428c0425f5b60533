"""`NoPrefixCache`: the no-cache case of the `PrefixCache` protocol frees every page handed to
it exactly when no lock holds it, and never matches."""

from __future__ import annotations

from hicache.pools import PageAllocator
from hicache.prefix_cache import NoPrefixCache


def test_nothing_matches_and_admission_is_counted():
    c = NoPrefixCache(PageAllocator(8), page_size=2)
    assert c.prefetch("r", [1, 2, 3]) == 0 and c.prefetch_ready("r")
    m = c.match_prefix([1, 2, 3, 4])
    assert (m.device_pages, m.device_tokens, m.host_tokens) == ([], 0, 0)
    acq = c.acquire([1, 2, 3], request_id="r", count=False)
    assert (acq.device_pages, acq.cached_tokens) == ([], 0)
    c.record_admission(acq, 4)
    c.release(acq.node)
    assert (c.stats.requests, c.stats.input_tokens, c.stats.hit_tokens) == (1, 4, 0)


def test_pages_are_freed_when_no_lock_holds_them():
    alloc = PageAllocator(8)
    c = NoPrefixCache(alloc, page_size=2)
    pages = c.alloc_device(3)
    assert pages is not None and alloc.num_free == 5
    # A chunked prefill hands over its first 2 pages and pins them.
    res = c.insert([1, 2, 3, 4], pages)
    assert res.device_pages == pages[:2] and res.new_tokens == 0
    c.lock(res.node)
    assert alloc.num_free == 5 and c.held_pages() == 2 and c.evictable_device_tokens() == 0
    # The next chunk: 3 pages, the first 2 still pinned by the old handle.
    res2 = c.insert([1, 2, 3, 4, 5, 6], pages)
    c.lock(res2.node)
    c.release(res.node)
    assert alloc.num_free == 5 and c.held_pages() == 3
    # The request finishes: insert (nothing new), release: every page is free again.
    c.insert([1, 2, 3, 4, 5, 6], pages)
    c.release(res2.node)
    assert alloc.num_free == 8 and c.held_pages() == 0
    # Pages inserted and never locked go at the next call.
    more = c.alloc_device(2)
    assert more is not None
    c.insert([9, 9, 9, 9], more)
    assert alloc.num_free == 6 and c.evictable_device_tokens() == 4
    c.poll()
    assert alloc.num_free == 8 and c.held_pages() == 0
