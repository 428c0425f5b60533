"""Tensor parallelism: one rank's view of its group (`TPGroup`) and how a group is started.

A TP engine runs one process per rank. Every rank holds its shard of the model (attention heads,
MLP columns) and its own KV pools and `HiRadixCache`; the model's partial sums meet in
`TPGroup.all_reduce` (gloo on CPU, NCCL on CUDA). Host-side agreement (which requests run, how
many pages a prefetch brought: `hicache.sync`) always goes over a gloo group (`cpu_group`), as in
SGLang, so that it never queues behind kernels on the device.

`TPGroup.solo()` is the one-rank group: every collective is the identity and nothing of
`torch.distributed` is touched, so single-rank code paths are the TP paths with `size == 1`.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hicache_client.errors import ConfigError

# How long a collective waits for the other ranks before it raises (`--dist-timeout`): a rank
# that died or diverged turns into an error on every other rank instead of a hang.
DEFAULT_DIST_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    # The model's collectives (gloo on CPU, nccl on CUDA); None when size == 1.
    group: Any = None
    # Host-side agreement (gloo, CPU tensors); None when size == 1.
    cpu_group: Any = None
    timeout_s: float = DEFAULT_DIST_TIMEOUT_S

    @classmethod
    def solo(cls) -> TPGroup:
        return cls()

    @property
    def is_solo(self) -> bool:
        return self.size == 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns `t`. Every rank gets bit-identical sums
        (each element is reduced once and then copied to every rank)."""
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `t` (equal shapes) concatenated along `dim`, in rank order."""
        if self.size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def part(self, n: int, what: str = "dimension") -> slice:
        """This rank's contiguous share of `n` items (`n` must divide evenly)."""
        if n % self.size:
            raise ConfigError(f"{what} of {n} does not split over tp_size {self.size}")
        k = n // self.size
        return slice(self.rank * k, (self.rank + 1) * k)


def init_tp_group(
    rank: int,
    size: int,
    *,
    init_method: str,
    device: torch.device,
    timeout_s: float = DEFAULT_DIST_TIMEOUT_S,
) -> TPGroup:
    """Join the process group of `size` ranks as `rank` (`init_method`: `tcp://127.0.0.1:PORT`).
    The model's backend is NCCL on CUDA and gloo on CPU; agreement always has a gloo group."""
    if size == 1:
        return TPGroup.solo()
    if not 0 <= rank < size:
        raise ConfigError(f"tp rank {rank} outside 0..{size - 1}")
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout
    )
    group = dist.group.WORLD
    cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return TPGroup(rank, size, group, cpu_group, timeout_s)


def destroy_tp_group(tp: TPGroup) -> None:
    if tp.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
