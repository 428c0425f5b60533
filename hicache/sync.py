"""Agreement between the tensor-parallel ranks of one engine.

Under tensor parallelism every rank runs its own `HiRadixCache` over its own shard of the KV (or,
for MLA, its own copy of the one latent), and one scheduler's decisions are replayed on every
rank. The trees stay identical only if every rank makes every decision the same way. Most
decisions depend on state that is identical by construction (the tree, the allocators, the
logical clock). The rest depend on something rank-local:

- which background transfers have finished (threads run at their own pace on each rank);
- how many pages a rank's L3 had or read (one rank's L3 can fail while another's does not);
- whether a rank's L3 is backing off after an error;
- a timer (the prefetch `timeout` policy);
- the measured cost model (bandwidths and prefill speed are timed per rank).

Before acting on any of those the ranks agree through `RankSync.agree`: the minimum (or maximum)
of each value over the ranks, in one collective. A rank whose L3 read failed therefore makes
every rank fall back together (SGLang does the same with MIN all-reduces over its TP group).

Rules that keep the ranks in lockstep (a broken one is a hang, bounded by the group's timeout,
or a `RankDivergence`):

1. Only the cache's owner thread calls `agree`; worker threads never do.
2. Every rank makes the same sequence of `agree` calls: whether a call happens may depend only on
   state that is identical on every rank or was itself agreed.
3. A value read from a worker thread (a prefetch's pages so far) is agreed before the tree uses
   it; an operation's result counts only once its completion has been agreed.

`RankSync` (one rank) answers at once and touches nothing; `GroupSync` all-reduces over a gloo
process group (CPU tensors: agreement never queues behind device work).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hicache_client.errors import HiCacheError


class RankDivergence(HiCacheError):
    """The ranks of a tensor-parallel group disagree on something that must be equal."""


class RankSync:
    """A group of one rank: every agreement is the identity, no collective is made."""

    rank: int = 0
    size: int = 1

    @property
    def solo(self) -> bool:
        return self.size == 1

    @property
    def writes_shared(self) -> bool:
        """Whether this rank writes pages that every rank shares (MLA: rank 0 only)."""
        return self.rank == 0

    def agree(
        self, mins: Sequence[int] = (), maxes: Sequence[int] = ()
    ) -> tuple[list[int], list[int]]:
        """Each of `mins` replaced by its minimum over the ranks, each of `maxes` by its
        maximum, in one collective."""
        return [int(v) for v in mins], [int(v) for v in maxes]

    def agree_min(self, *values: int) -> list[int]:
        return self.agree(mins=values)[0]

    def all_true(self, *flags: bool) -> list[bool]:
        """Per flag: whether it is true on every rank."""
        return [bool(v) for v in self.agree(mins=[int(f) for f in flags])[0]]

    def check(self, what: str, values: Sequence[int]) -> None:
        """Raise `RankDivergence` when the ranks' `values` differ (one collective)."""
        return None


class GroupSync(RankSync):
    """`RankSync` over a `torch.distributed` gloo group of `size` ranks."""

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self.group = group
        self.rank = rank
        self.size = size
        self.collectives = 0  # calls made (the cost of agreement, for stats and tests)

    def agree(
        self, mins: Sequence[int] = (), maxes: Sequence[int] = ()
    ) -> tuple[list[int], list[int]]:
        import torch
        import torch.distributed as dist

        n = len(mins)
        t = torch.tensor([*map(int, mins), *(-int(v) for v in maxes)], dtype=torch.int64)
        if t.numel() == 0:
            t = torch.zeros(1, dtype=torch.int64)  # every rank still makes the call
        self.collectives += 1
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        out = t.tolist()
        return out[:n], [-v for v in out[n : n + len(maxes)]]

    def check(self, what: str, values: Sequence[int]) -> None:
        lo, hi = self.agree(mins=values, maxes=values)
        if lo != hi:
            bad = [i for i, (a, b) in enumerate(zip(lo, hi)) if a != b]
            raise RankDivergence(
                f"tensor-parallel ranks disagree on {what} at positions {bad[:8]} "
                f"(rank {self.rank} has {[values[i] for i in bad[:8]]}; min {[lo[i] for i in bad[:8]]}, "
                f"max {[hi[i] for i in bad[:8]]})"
            )


SOLO = RankSync()
