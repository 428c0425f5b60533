"""Cache events: what a `HiRadixCache` tells the outside world about the pages it holds.

The cache calls its `EventSink` (if one is set) on the owner thread, synchronously, at the moment
the tree's state changes; a sink must be cheap (append to a list, put on a queue). Exporters that
publish the events (for example over ZeroMQ in vLLM's KV-events wire format) live outside the
core, in `engine/`.

Every event names pages by their *block hash*: the first 8 bytes of the page's chained SHA-256
digest (`hicache_client.keys`), read as a signed big-endian 64-bit integer. Two engines with the same
model, layout and `extra_key` derive the same hashes for the same tokens, so a router can match
the events of every instance against one request.

Tiers: ``"device"`` (L1), ``"host"`` (L2), ``"storage"`` (L3). A page on several tiers has one
`BlockStored` per tier and one `BlockRemoved` per tier when it leaves it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Tier = Literal["device", "host", "storage"]
TIERS: tuple[Tier, ...] = ("device", "host", "storage")


def block_hash(digest: bytes) -> int:
    """The event name of a page: its digest's first 8 bytes as a signed big-endian int64."""
    return int.from_bytes(digest[:8], "big", signed=True)


@dataclass(frozen=True)
class BlockStored:
    """Pages that became present on `tier`, in prefix order (each page's parent is the previous
    one; the first page's parent is `parent_hash`, None at the root)."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[int, ...]  # len == len(block_hashes) * page_size
    page_size: int
    tier: Tier
    extra_key: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Pages that left `tier` (evicted, dropped, or failed to be written)."""

    block_hashes: tuple[int, ...]
    tier: Tier


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every page left `tier` (or every tier when `tier` is None): a reset or flush."""

    tier: Tier | None = None


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
EventSink = Callable[[CacheEvent], None]
