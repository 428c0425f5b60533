"""What is written to L3 and how long a prefix stays: L3 admission and per-request cache hints.

`Admission` decides, page run by page run, whether pages the tree holds on device/host are worth
writing to L3 (`--hicache-storage-admission`):

- `always` (the default): every page backed up to host is written to L3 (SGLang's behaviour);
- `reuse:N`: a page is written once it has been hit N times after the request that computed it
  (vLLM's offloading `store_threshold`): a prompt sent once, then twice more, reaches L3 after
  the third;
- `frequency[:HALF_LIFE]`: a decaying count (Dynamo KVBM's): a page's count starts at 1, doubles
  on each later use and is halved for every HALF_LIFE requests (default 1000) the cache admitted
  since its last use; it is written once the count reaches 2 (used twice within a half-life).

Counts are kept per page digest (`TreeNode.page_keys`), in a bounded table, so they survive a
page leaving the tree and coming back (a prompt recomputed after eviction still counts). The
clock is the number of requests the cache admitted, not wall time: a replay of a trace through
the simulated cache (`hicache-hitrate`) makes the engine's decisions exactly.

Pages admission declined go into a small bounded sketch (`Declined`); a later request that
recomputes one of them counts a page L3 would have served had it been written
(`CacheStats.storage_declined_rehit_pages`).

`CacheHints` is what one request asks of the cache: `skip_cache_write` (none of its new pages
goes below the device, and they are evicted first), `retention_seconds` (a soft pin of its
prefix, bounded by `HiCacheConfig.max_retention_seconds`) and `priority` (read by the `priority`
eviction policy).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from hicache_client.errors import ConfigError

# Entries of a count table and of the declined sketch (FIFO beyond: the oldest is forgotten).
COUNT_TABLE_KEYS = 1 << 18
DECLINED_SKETCH_KEYS = 1 << 16
DEFAULT_HALF_LIFE = 1000  # requests, for `frequency`
ADMISSION_SPECS = "always | reuse:N | frequency[:HALF_LIFE_REQUESTS]"


def page_id(digest: bytes) -> int:
    """A page's table key: the first 8 bytes of its digest (stable across processes)."""
    return int.from_bytes(digest[:8], "little")


class Admission(ABC):
    name: ClassVar[str]

    def __init__(self, capacity: int = COUNT_TABLE_KEYS) -> None:
        self.capacity = capacity
        self.counts: dict[int, Any] = {}
        self.requests = 0  # the logical clock: requests admitted

    @property
    def counts_uses(self) -> bool:
        """Whether `seen` does anything (False: the tree skips hashing pages for it)."""
        return True

    def tick(self) -> None:
        """One request was admitted (the clock of `frequency`)."""
        self.requests += 1

    @abstractmethod
    def seen(self, digests: Sequence[bytes]) -> None:
        """One request used these pages (computed them, or hit them on device/host)."""

    @abstractmethod
    def admits(self, digests: Sequence[bytes]) -> bool:
        """Whether every one of these pages may be written to L3 now."""

    def _bound(self) -> None:
        while len(self.counts) > self.capacity:
            del self.counts[next(iter(self.counts))]

    def spec(self) -> str:
        return self.name


class Always(Admission):
    name = "always"

    @property
    def counts_uses(self) -> bool:
        return False

    def seen(self, digests: Sequence[bytes]) -> None:
        pass

    def admits(self, digests: Sequence[bytes]) -> bool:
        return True


class Reuse(Admission):
    """Written once a page has been used `n + 1` times (computed once, then hit `n` times)."""

    name = "reuse"

    def __init__(self, n: int, capacity: int = COUNT_TABLE_KEYS) -> None:
        super().__init__(capacity)
        self.n = n

    def seen(self, digests: Sequence[bytes]) -> None:
        c = self.counts
        for d in digests:
            k = page_id(d)
            c[k] = c.pop(k, 0) + 1  # re-inserted: the table forgets the least recently used
        self._bound()

    def admits(self, digests: Sequence[bytes]) -> bool:
        c = self.counts
        return all(c.get(page_id(d), 0) > self.n for d in digests)

    def spec(self) -> str:
        return f"reuse:{self.n}"


class Frequency(Admission):
    """KVBM's: a count that doubles on each use and halves every `half_life` requests; written
    once it reaches `threshold` (2: used twice within about a half-life)."""

    name = "frequency"
    threshold = 2.0

    def __init__(self, half_life: int = DEFAULT_HALF_LIFE,
                 capacity: int = COUNT_TABLE_KEYS) -> None:
        super().__init__(capacity)
        self.half_life = half_life

    def _now(self, k: int) -> float:
        e = self.counts.get(k)
        if e is None:
            return 0.0
        f, t = e
        # Halved once per whole half-life gone by (KVBM decays by periodic halving).
        return float(f * 0.5 ** ((self.requests - t) // self.half_life))

    def seen(self, digests: Sequence[bytes]) -> None:
        c = self.counts
        for d in digests:
            k = page_id(d)
            f = self._now(k)
            c.pop(k, None)
            c[k] = (max(1.0, 2.0 * f), self.requests)
        self._bound()

    def admits(self, digests: Sequence[bytes]) -> bool:
        return all(self._now(page_id(d)) >= self.threshold for d in digests)

    def spec(self) -> str:
        return f"frequency:{self.half_life}"


def make_admission(spec: str) -> Admission:
    """`always`, `reuse:N` (N >= 1) or `frequency[:HALF_LIFE]` (requests, >= 1)."""
    name, _, arg = spec.strip().partition(":")
    try:
        if name == "always" and not arg:
            return Always()
        if name == "reuse":
            n = int(arg)
            if n >= 1:
                return Reuse(n)
        if name == "frequency":
            h = int(arg) if arg else DEFAULT_HALF_LIFE
            if h >= 1:
                return Frequency(h)
    except ValueError:
        pass
    raise ConfigError(f"storage admission {spec!r}: expected {ADMISSION_SPECS}")


class Declined:
    """A bounded FIFO set of the pages admission declined (their `page_id`s)."""

    def __init__(self, capacity: int = DECLINED_SKETCH_KEYS) -> None:
        self.capacity = capacity
        self.ids: dict[int, None] = {}

    def add(self, digests: Sequence[bytes]) -> None:
        for d in digests:
            self.ids[page_id(d)] = None
        while len(self.ids) > self.capacity:
            del self.ids[next(iter(self.ids))]

    def discard(self, digests: Sequence[bytes]) -> None:
        for d in digests:
            self.ids.pop(page_id(d), None)

    def count(self, digests: Sequence[bytes]) -> int:
        """How many of these pages were declined (and not written since)."""
        return sum(page_id(d) in self.ids for d in digests)

    def __contains__(self, digest: bytes) -> bool:
        return page_id(digest) in self.ids


# -- per-request hints ---------------------------------------------------------------------------

HINT_FIELDS = ("skip_cache_write", "retention_seconds", "priority")


@dataclass(frozen=True)
class CacheHints:
    """What one request asks of the cache (see the module docstring)."""

    skip_cache_write: bool = False
    retention_seconds: float = 0.0
    priority: int = 0

    @classmethod
    def from_any(cls, value: CacheHints | Mapping[str, Any] | None) -> CacheHints:
        """From a mapping of the hint fields (None values: the default). A wrong type or an
        unknown field raises `TypeError` naming it; a negative retention `ValueError`."""
        if value is None:
            return NO_HINTS
        if isinstance(value, CacheHints):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"cache hints must be a mapping, got {type(value).__name__}")
        unknown = sorted(set(value) - set(HINT_FIELDS))
        if unknown:
            raise TypeError(f"unknown cache hint {unknown[0]!r}; known: {', '.join(HINT_FIELDS)}")
        skip = value.get("skip_cache_write")
        ret = value.get("retention_seconds")
        pri = value.get("priority")
        if skip is not None and not isinstance(skip, bool):
            raise TypeError(f"skip_cache_write must be a boolean, got {type(skip).__name__}")
        if ret is not None and (isinstance(ret, bool) or not isinstance(ret, (int, float))):
            raise TypeError(f"retention_seconds must be a number, got {type(ret).__name__}")
        if pri is not None and (isinstance(pri, bool) or not isinstance(pri, int)):
            raise TypeError(f"priority must be an integer, got {type(pri).__name__}")
        if ret is not None and not ret >= 0:
            raise ValueError(f"retention_seconds must be >= 0, got {ret}")
        return cls(bool(skip), float(ret or 0.0), int(pri or 0))

    def as_dict(self) -> dict[str, Any]:
        """Only the fields that differ from the defaults (what travels between processes)."""
        d: dict[str, Any] = {}
        if self.skip_cache_write:
            d["skip_cache_write"] = True
        if self.retention_seconds:
            d["retention_seconds"] = self.retention_seconds
        if self.priority:
            d["priority"] = self.priority
        return d


NO_HINTS = CacheHints()
