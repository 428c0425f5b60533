"""The attention interface and `ForwardBatch`, the per-step description the model runs on.

A batch is a flat, ragged run of `T` new tokens from `B` requests. Request `i` contributes
`q_lens[i]` new tokens at the end of a sequence of `kv_lens[i]` tokens (cached prefix + new);
its K/V live in the device pool's pages `page_table[i, :ceil(kv_lens[i] / page_size)]`, and
`out_slots` are where the new tokens' K/V are written. Attention reads and writes K/V only
through the `DeviceKVPool`.

Step metadata is built once per step as tensors on the pool's device (token ids, positions,
output slots, one padded int32 page table, lengths and offsets) from two (pinned, on CUDA) host
buffers: two host-to-device copies, no device-to-host sync, no Python work per token beyond
listing the ids and positions. The host
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
        pos: list[int] = []
        slots: list[int] = []
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
            pos.extend(range(start, kv_len))
            # Output slots page by page (never a Python step per token when page_size > 1).
            i = start
            while i < kv_len:
                off = i % ps
                take = min(ps - off, kv_len - i)
                base = pages[i // ps] * ps + off
                slots.extend(range(base, base + take))
                i += take
            q_lens.append(n)
            kv_lens.append(kv_len)
            widths.append(-(-kv_len // ps))
        b, p, t = len(seqs), max(widths), len(ids)
        q_starts = [0]
        for n in q_lens:
            q_starts.append(q_starts[-1] + n)
        last = last_only and t > b  # decode: one row per request already
        # One int64 host buffer [ids | positions | out slots | logits rows] and one int32
        # [q_lens | kv_lens | q_starts | page table]: two copies to the device, no sync.
        big = ids + pos + slots + (q_starts[1:] if last else [])
        meta: list[int] = q_lens + kv_lens + q_starts
        for (_, _, pages), w in zip(seqs, widths):
            meta.extend(pages[:w])
            meta.extend([0] * (p - w))
        pin = dev.type == "cuda"
        dbig = torch.tensor(big, dtype=torch.int64, pin_memory=pin).to(dev, non_blocking=True)
        dmeta = torch.tensor(meta, dtype=torch.int32, pin_memory=pin).to(dev, non_blocking=True)
        return cls(
            input_ids=dbig[:t], positions=dbig[t : 2 * t], out_slots=dbig[2 * t : 3 * t],
            page_table=dmeta[3 * b + 1 :].view(b, p), q_lens_t=dmeta[:b],
            kv_lens_t=dmeta[b : 2 * b], q_starts=dmeta[2 * b : 3 * b + 1], page_size=ps,
            q_lens=q_lens, kv_lens=kv_lens, logits_rows=dbig[3 * t :] - 1 if last else None,
            wait_layer=wait_layer,
        )


class AttentionBackend(ABC):
    """Paged attention over a `DeviceKVPool`.

    `prepare(batch)` runs once per step (shared metadata for all layers); `forward` runs once per
    layer: it first writes the new tokens' K/V into `batch.out_slots` of layer `layer` (a slot of
    -1 is skipped, backends that support CUDA graphs only), then attends each request's queries
    over its pages with a causal mask offset by the cached prefix. Returns
    `[T, num_heads * v_head_dim]`.

    Over an MLA pool (`pool.mla`: one latent per token) `forward` gets the latent as `k`
    (`[T, 1, head_dim]`) and no `v`: it writes the latent, scores the queries (`[T, H,
    head_dim]`, already in latent space) against whole latents and takes the first
    `v_head_dim` dims of each latent as its value (multi-query attention over the latent).
    """

    name: str = "base"
    # Whether `forward` of a decode batch reads only tensors (no host values), so that a decode
    # step can be captured in a CUDA graph and replayed with new tensor contents.
    supports_cuda_graph: bool = False

    def __init__(
        self,
        pool: DeviceKVPool,
        num_heads: int,
        head_dim: int,
        scale: float,
        v_head_dim: int | None = None,
    ) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        if pool.head_dim != head_dim:
            raise ValueError(f"pool rows are {pool.head_dim} wide, q/k heads {head_dim}")
        if not pool.mla and self.v_head_dim != head_dim:
            raise ValueError("a K/V pool holds V as wide as K")
        if pool.mla and not 0 < self.v_head_dim <= head_dim:
            raise ValueError(f"V ({self.v_head_dim} dims) must be a prefix of the latent")

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D] (MLA: the latent, [T, 1, D])
        v: torch.Tensor | None,  # [T, Hkv, D] (MLA: None)
        batch: ForwardBatch,
    ) -> torch.Tensor: ...
