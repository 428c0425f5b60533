"""Miss attribution: every prompt token of an admitted request comes to exactly one outcome.

A hit on one tier (`device_hit`, `host_hit`, `storage_hit`) or a miss with its cause
(`MISS_CAUSES`). `HiRadixCache.acquire` attributes the tokens it was given (`Acquired.outcomes`);
`record_admission` adds the prompt tokens past those (the engine never looks up the last prompt
token of a page-aligned prompt, and no partial page is cached) as `uncacheable`, so the counts of
a request sum to its prompt tokens exactly.

Where a missed page was, the cache tells from three sources, in this order:

1. the tree itself: pages it holds on host that the request did not load (the cost model, the
   load-back threshold, no device room);
2. the request's prefetch (`Prefetcher.note`): what L3 was asked and what came of it (late,
   corrupt, read failed, the host share used up, under the floor, ...);
3. for the pages left (not in the tree, not found in L3 or not asked), the bounded sketch of
   recently evicted pages (`EvictedSketch`): evicted from the device without a host copy,
   dropped from host before L3 had it, or written to L3 (and not found there: L3 evicted it);
   admission's sketch of pages it declined (`hicache.admission.Declined`); the tree's other
   namespaces (the same tokens cached under another `extra_key`, up to `OTHER_ROOTS_CHECKED`
   of them). A page in none of them was never seen (or seen longer ago than the sketch holds).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hicache.admission import page_id
from hicache_client.keys import page_keys

if TYPE_CHECKING:
    from hicache.radix import Tokens, TreeNode

HIT_OUTCOMES: tuple[str, ...] = ("device_hit", "host_hit", "storage_hit")
MISS_CAUSES: tuple[str, ...] = (
    "never_seen",  # not in the tree, L3 or the sketches: new, or seen longer ago than they hold
    "evicted_device",  # evicted from the device with no host copy (not backed up)
    "evicted_host",  # dropped from host memory before L3 had it (or with no L3)
    "skip_cache_write",  # evicted from the device only, as its request's skip_cache_write asked
    "admission_declined",  # L3 admission declined to write it (`--hicache-storage-admission`)
    "l3_evicted",  # written to L3, but L3 no longer had it when asked
    "below_prefetch_floor",  # on L3 (or written there) but the gap was under the prefetch floor
    "prefetch_timeout",  # L3 was still being asked or read when the request was admitted
    "prefetch_host_capacity",  # on L3, but no host memory (or prefetch share) to read it into
    "storage_unavailable",  # on L3, but L3 was backing off after errors: not asked
    "corrupt",  # the read stopped at a record that failed validation
    "read_failed",  # the read stopped at a page that was gone, or the backend failed
    "evicted_before_use",  # read from L3, but the prefix it extends left the tree before admission
    "other_namespace",  # cached under another namespace (extra_key / cache_salt) only
    "recomputed_by_cost_model",  # cached, but recomputing was measured cheaper than loading
    "below_load_threshold",  # on host, but fewer tokens than the load-back threshold
    "device_capacity",  # on host, but no device room to load it
    "uncacheable",  # past the last full page looked up (a partial page, the last prompt token)
)
OUTCOMES: tuple[str, ...] = HIT_OUTCOMES + MISS_CAUSES

# Pages the evicted sketch remembers (FIFO beyond). One entry is an int key and a small int in
# an OrderedDict: about 100 bytes, so 6-7 MB at this bound (tests/hicache/test_attribution.py).
EVICTED_SKETCH_PAGES = 1 << 16
OTHER_ROOTS_CHECKED = 8

# What the sketch remembers of a page when it left its last tier.
EVICTED_DEVICE, EVICTED_HOST, IN_L3, SKIPPED_WRITE = range(4)
_SKETCH_CAUSE = {
    EVICTED_DEVICE: "evicted_device", EVICTED_HOST: "evicted_host",
    SKIPPED_WRITE: "skip_cache_write",
}


def no_attribution() -> dict[str, int]:
    return dict.fromkeys(OUTCOMES, 0)


class EvictedSketch:
    """A bounded FIFO map from page id (`hicache.admission.page_id` of its digest) to what was
    known of the page when it left the cache's last tier. Lookups do not refresh."""

    def __init__(self, capacity: int = EVICTED_SKETCH_PAGES) -> None:
        self.capacity = capacity
        self.pages: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self.pages)

    def add(self, digests: Sequence[bytes], what: int) -> None:
        p = self.pages
        for d in digests:
            k = page_id(d)
            p.pop(k, None)
            p[k] = what
        while len(p) > self.capacity:
            p.popitem(last=False)

    def get(self, digest: bytes) -> int | None:
        return self.pages.get(page_id(digest))

    def clear(self) -> None:
        self.pages.clear()


def left_cache(node: TreeNode, write_pending: bool = False) -> int:
    """What the sketch records of `node`'s pages as they leave their last tier."""
    if node.stored or write_pending:
        return IN_L3
    if getattr(node, "no_write", False):
        return SKIPPED_WRITE
    return EVICTED_DEVICE if node.host_value is None else EVICTED_HOST


# A prefetch's account of the pages it was asked for, from its first page on: runs of
# (pages, cause); cause None: L3 was asked and did not have them (the sketch says why).
Note = tuple[int, list[tuple[int, "str | None"]]]


def classify(
    digest: bytes,
    probed: bool,
    unprobed: str,
    sketch: EvictedSketch,
    declined: object,
) -> str:
    """The cause of one missed page that is neither in the tree nor accounted for by a prefetch.
    `probed`: L3 was asked and had it not; `unprobed`: why L3 was not asked (a cause)."""
    if declined is not None and digest in declined:  # type: ignore[operator]
        return "admission_declined"
    what = sketch.get(digest)
    if what is None:
        return "never_seen"
    if what == IN_L3:
        return "l3_evicted" if probed else unprobed
    return _SKETCH_CAUSE[what]


def add_into(total: dict[str, int], part: Mapping[str, int]) -> None:
    for k, v in part.items():
        if v:
            total[k] += v


def complete(outcomes: Mapping[str, int] | None, prompt_tokens: int) -> dict[str, int]:
    """A request's attribution over all `prompt_tokens`: `outcomes` (of the tokens looked up)
    plus the rest as `uncacheable`. Only nonzero outcomes."""
    out = {k: v for k, v in (outcomes or {}).items() if v}
    rest = prompt_tokens - sum(out.values())
    if rest < 0:
        raise ValueError(f"{sum(out.values())} tokens attributed of a {prompt_tokens}-token prompt")
    if rest:
        out["uncacheable"] = out.get("uncacheable", 0) + rest
    return out


def attribute(
    c: Any,
    t: Tokens,
    extra_key: str | None,
    last: TreeNode,
    dev_tokens: int,
    host_tokens: int,
    wanted: int,
    loaded: int,
    storage_hit: int,
    note: Note | None,
    unprobed: str,
) -> dict[str, int]:
    """(`c`: the `HiRadixCache`; not imported, it imports this module.)

    The outcome of each of the tokens `t` one admission looked up (`HiRadixCache._acquire`):
    `dev_tokens` on the device, then `host_tokens` on host of which `wanted` were planned and
    `loaded` loaded (`storage_hit` of those brought by the prefetch), the tree's match ending at
    `last`; the pages past it from the prefetch's `note` and the sketches."""
    ps = c.page_size
    out = no_attribution()
    out["device_hit"] = dev_tokens
    out["storage_hit"] = storage_hit
    out["host_hit"] = loaded - storage_hit
    out["recomputed_by_cost_model"] = host_tokens - wanted
    below = wanted < c.config.load_back_threshold
    out["below_load_threshold" if below else "device_capacity"] += wanted - loaded
    first = (dev_tokens + host_tokens) // ps
    n_full = len(t) // ps
    out["uncacheable"] = len(t) - n_full * ps
    if first >= n_full:
        return out
    # Page by page from `first`: a cause, or None (not found in L3: the sketches say why), or
    # "" (not asked of L3: the sketches say why, with `unprobed` for pages L3 had).
    causes: list[str | None] = [""] * (n_full - first)
    if note is not None:
        pos = note[0]
        for pages, cause in note[1]:
            lo, hi = max(pos, first), min(pos + pages, n_full)
            for i in range(lo, hi):
                causes[i - first] = cause
            pos += pages
    open_ = [i for i, x in enumerate(causes) if not x]
    if open_:
        sketch = c.evicted
        declined = c.declined if len(c.declined.ids) else None
        if sketch is not None and (len(sketch) or declined is not None):
            digests = page_keys(t[first * ps : n_full * ps], ps, c.chain.last_digest(last))
            for i in open_:
                causes[i] = classify(digests[i], causes[i] is None, unprobed, sketch, declined)
        else:
            for i in open_:
                causes[i] = "never_seen"
        _other_namespaces(c, t, extra_key, first, causes)
    for x in causes:
        out[x or "never_seen"] += ps
    return out


def _other_namespaces(
    c: Any, t: Tokens, extra_key: str | None, first: int, causes: list[str | None]
) -> None:
    """Pages never seen here that the tree holds under another namespace (up to
    OTHER_ROOTS_CHECKED of them): `other_namespace`."""
    roots = c.tree.roots
    if len(roots) < 2 or "never_seen" not in causes:
        return
    ps = c.page_size
    own = c.tree.root(extra_key)
    checked = 0
    for root in list(roots.values()):
        if root is own:
            continue
        if checked == OTHER_ROOTS_CHECKED:
            break
        checked += 1
        m = c.tree.match(t, root.extra_key)
        pages = m.matched_tokens // ps
        for i in range(first, min(pages, first + len(causes))):
            if causes[i - first] == "never_seen":
                causes[i - first] = "other_namespace"
