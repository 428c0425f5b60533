"""The attention interface and `ForwardBatch`, the per-step description the model runs on.

A batch is a flat, ragged run of `T` new tokens from `B` requests. Request `i` contributes
`q_lens[i]` new tokens at the end of a sequence of `kv_lens[i]` tokens (cached prefix + new);
its K/V live in the device pool's pages `page_table[i, :ceil(kv_lens[i] / page_size)]`, and
`out_slots` are where the new tokens' K/V are written. Attention reads and writes K/V only
through the `DeviceKVPool`.

Step metadata is built once per step as tensors on the pool's device (one padded int32 page
table, lengths and offsets; positions and output slots are computed on the device), with two
host-to-device copies from (pinned, on CUDA) host tensors and no device-to-host sync. The host
lists `q_lens` / `kv_lens` are kept for backends that loop on the host (the `torch` backend).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache.pools import DeviceKVPool

# (new_token_ids, start_position, page_table) of one request in a step.
Seq = tuple[Sequence[int], int, Sequence[int]]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64 token ids of the new tokens
    positions: torch.Tensor  # [T] int64 position of each new token in its sequence
    out_slots: torch.Tensor  # [T] int64 pool slot each new token's K/V is written to (-1: none)
    page_table: torch.Tensor  # [B, P] int32 page ids per request, padded with 0
    q_lens_t: torch.Tensor  # [B] int32 new tokens per request
    kv_lens_t: torch.Tensor  # [B] int32 tokens attended per request (cached prefix + new)
    q_starts: torch.Tensor  # [B + 1] int32 first row of each request in the flat batch
    page_size: int
    q_lens: list[int]  # host copy of q_lens_t
    kv_lens: list[int]  # host copy of kv_lens_t
    # Rows of the T outputs to compute logits for (None: every row).
    logits_rows: torch.Tensor | None = None
    # Called with i before layer i reads the KV pool (layer-wise load-back waits there).
    wait_layer: Callable[[int], None] | None = None
    # Backend-prepared metadata (filled by `AttentionBackend.prepare`).
    meta: Any = field(default=None, repr=False)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens)

    @property
    def is_decode(self) -> bool:
        return self.max_q_len == 1

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def kv_slots(self) -> torch.Tensor:
        """`[B, P * page_size]` int64 slot of every position of every request's page table
        (positions past `kv_lens[i]` point at whatever the padding pages hold)."""
        ps = self.page_size
        off = torch.arange(ps, device=self.page_table.device)
        return (self.page_table.long()[:, :, None] * ps + off).reshape(self.batch_size, -1)

    @classmethod
    def build(
        cls,
        pool: DeviceKVPool,
        seqs: Sequence[Seq],
        *,
        last_only: bool = True,
        wait_layer: Callable[[int], None] | None = None,
    ) -> ForwardBatch:
        """`seqs`: per request `(new_token_ids, start_position, page_table)`; the page table must
        cover `start_position + len(new_token_ids)` slots. `last_only`: logits of each request's
        last token only (else of every token)."""
        if not seqs:
            raise ValueError("a forward batch needs at least one request")
        dev = pool.device
        ps = pool.page_size
        ids: list[int] = []
        q_lens: list[int] = []
        kv_lens: list[int] = []
        widths: list[int] = []
        for new, start, pages in seqs:
            n = len(new)
            kv_len = start + n
            if n < 1:
                raise ValueError("every request of a forward batch needs a new token")
            if len(pages) * ps < kv_len:
                raise ValueError(f"page table covers {len(pages) * ps} slots, need {kv_len}")
            ids.extend(new)
            q_lens.append(n)
            kv_lens.append(kv_len)
            widths.append(-(-kv_len // ps))
        b, p, t = len(seqs), max(widths), len(ids)
        # One int32 host buffer [q_lens | kv_lens | page table], one copy to the device.
        meta: list[int] = q_lens + kv_lens
        for (_, _, pages), w in zip(seqs, widths):
            meta.extend(pages[:w])
            meta.extend([0] * (p - w))
        pin = dev.type == "cuda"
        host_meta = torch.tensor(meta, dtype=torch.int32, pin_memory=pin)
        host_ids = torch.tensor(ids, dtype=torch.int64, pin_memory=pin)
        dmeta = host_meta.to(dev, non_blocking=True)
        input_ids = host_ids.to(dev, non_blocking=True)
        q_lens_t, kv_lens_t = dmeta[:b], dmeta[b : 2 * b]
        page_table = dmeta[2 * b :].view(b, p)
        q_starts = torch.zeros(b + 1, dtype=torch.int32, device=dev)
        torch.cumsum(q_lens_t, 0, dtype=torch.int32, out=q_starts[1:])
        if t == b:  # one new token per request (decode): row i is request i
            req = torch.arange(b, device=dev)
            positions = (kv_lens_t - 1).long()
        else:
            req = torch.repeat_interleave(
                torch.arange(b, device=dev), q_lens_t.long(), output_size=t
            )
            prefix = (kv_lens_t - q_lens_t - q_starts[:-1]).long()
            positions = torch.arange(t, device=dev) + prefix[req]
        out_slots = page_table[req, positions // ps].long() * ps + positions % ps
        rows = None if (not last_only or t == b) else (q_starts[1:] - 1).long()
        return cls(
            input_ids=input_ids, positions=positions, out_slots=out_slots, page_table=page_table,
            q_lens_t=q_lens_t, kv_lens_t=kv_lens_t, q_starts=q_starts, page_size=ps,
            q_lens=q_lens, kv_lens=kv_lens, logits_rows=rows, wait_layer=wait_layer,
        )


class AttentionBackend(ABC):
    """Paged attention over a `DeviceKVPool`.

    `prepare(batch)` runs once per step (shared metadata for all layers); `forward` runs once per
    layer: it first writes the new tokens' K/V into `batch.out_slots` of layer `layer` (a slot of
    -1 is skipped, backends that support CUDA graphs only), then attends each request's queries
    over its pages with a causal mask offset by the cached prefix. Returns
    `[T, num_heads * head_dim]`.
    """

    name: str = "base"
    # Whether `forward` of a decode batch reads only tensors (no host values), so that a decode
    # step can be captured in a CUDA graph and replayed with new tensor contents.
    supports_cuda_graph: bool = False

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
