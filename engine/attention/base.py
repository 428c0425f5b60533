"""The attention interface and `ForwardBatch`, the per-step description the model runs on.

A batch is a flat run of `T` new tokens from one or more requests. Request `i` contributes
`q_lens[i]` new tokens at the end of a sequence of `kv_lens[i]` tokens; `kv_slots[i]` are the
device-pool slots of that whole sequence (cached prefix + new tokens), and `out_slots` are where
the new tokens' K/V are written. Attention reads and writes K/V only through the `DeviceKVPool`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache.pools import DeviceKVPool


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64 token ids of the new tokens
    positions: torch.Tensor  # [T] int64 position of each new token in its sequence
    out_slots: torch.Tensor  # [T] int64 pool slot each new token's K/V is written to
    q_lens: list[int]  # new tokens per request
    kv_lens: list[int]  # tokens attended per request (cached prefix + new)
    kv_slots: list[torch.Tensor]  # per request: [kv_len] int64 slots of the whole sequence
    # Rows of the T outputs to compute logits for (None: every row).
    logits_rows: torch.Tensor | None = None
    # Backend-prepared metadata (filled by `AttentionBackend.prepare`).
    meta: Any = field(default=None, repr=False)

    @property
    def is_decode(self) -> bool:
        return all(q == 1 for q in self.q_lens)

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @classmethod
    def build(
        cls,
        pool: DeviceKVPool,
        seqs: list[tuple[list[int], int, list[int]]],
        *,
        last_only: bool = True,
    ) -> ForwardBatch:
        """`seqs`: per request `(new_token_ids, start_position, page_table)`; the page table must
        cover `start_position + len(new_token_ids)` slots. `last_only`: logits of each request's
        last token only (else of every token)."""
        dev = pool.device
        ids: list[int] = []
        pos: list[int] = []
        q_lens: list[int] = []
        kv_lens: list[int] = []
        kv_slots: list[torch.Tensor] = []
        out: list[torch.Tensor] = []
        rows: list[int] = []
        for new, start, pages in seqs:
            n = len(new)
            kv_len = start + n
            slots = pool.slots(pages, kv_len)
            if slots.numel() < kv_len:
                raise ValueError(f"page table covers {slots.numel()} slots, need {kv_len}")
            ids.extend(new)
            pos.extend(range(start, kv_len))
            q_lens.append(n)
            kv_lens.append(kv_len)
            kv_slots.append(slots)
            out.append(slots[start:])
            rows.append(len(ids) - 1)
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            out_slots=torch.cat(out) if out else torch.empty(0, dtype=torch.int64, device=dev),
            q_lens=q_lens,
            kv_lens=kv_lens,
            kv_slots=kv_slots,
            logits_rows=torch.tensor(rows, dtype=torch.int64, device=dev) if last_only else None,
        )


class AttentionBackend(ABC):
    """Paged attention over a `DeviceKVPool`.

    `prepare(batch)` runs once per step (shared metadata for all layers); `forward` runs once per
    layer: it first writes the new tokens' K/V into `batch.out_slots` of layer `layer`, then
    attends each request's queries over its `kv_slots` with a causal mask offset by the cached
    prefix. Returns `[T, num_heads * head_dim]`.
    """

    name: str = "base"

    def __init__(self, pool: DeviceKVPool, num_heads: int, head_dim: int, scale: float) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        batch: ForwardBatch,
    ) -> torch.Tensor: ...
