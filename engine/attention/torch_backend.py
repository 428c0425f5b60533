"""`torch` attention: scaled_dot_product_attention over K/V gathered from the pool's pages.

Prefill (any request with more than one new token) runs request by request with an explicit
causal mask offset by the cached prefix; a pure decode batch gathers every request's K/V into one
padded `[B, max_len]` block and runs a single SDPA call with a padding mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, ForwardBatch


@dataclass
class _DecodeMeta:
    slots: torch.Tensor  # [B, max_len] (padding points at slot 0)
    mask: torch.Tensor  # [B, 1, 1, max_len] bool, True = attend


@dataclass
class _PrefillMeta:
    starts: list[int]  # first row of each request in the flat batch
    masks: list[torch.Tensor | None]  # [q_len, kv_len] bool, None when q_len == 1


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prepare(self, batch: ForwardBatch) -> None:
        dev = self.pool.device
        if batch.is_decode:
            max_len = max(batch.kv_lens)
            slots = torch.zeros((batch.batch_size, max_len), dtype=torch.int64, device=dev)
            ar = torch.arange(max_len, device=dev)
            lens = torch.tensor(batch.kv_lens, device=dev)
            for i, s in enumerate(batch.kv_slots):
                slots[i, : s.numel()] = s
            batch.meta = _DecodeMeta(slots, (ar[None, :] < lens[:, None])[:, None, None, :])
            return
        starts: list[int] = []
        masks: list[torch.Tensor | None] = []
        row = 0
        for q_len, kv_len in zip(batch.q_lens, batch.kv_lens):
            starts.append(row)
            row += q_len
            if q_len == 1:
                masks.append(None)
                continue
            qi = torch.arange(q_len, device=dev)[:, None] + (kv_len - q_len)
            kj = torch.arange(kv_len, device=dev)[None, :]
            masks.append(kj <= qi)
        batch.meta = _PrefillMeta(starts, masks)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        pool = self.pool
        pool.set_kv(layer, batch.out_slots, k, v)
        kbuf, vbuf = pool.k_buffer[layer], pool.v_buffer[layer]
        gqa = self.num_heads != pool.kv_heads
        meta = batch.meta
        if isinstance(meta, _DecodeMeta):
            kk = kbuf[meta.slots].transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
            vv = vbuf[meta.slots].transpose(1, 2).to(q.dtype)
            o = F.scaled_dot_product_attention(
                q[:, :, None, :], kk, vv, attn_mask=meta.mask, scale=self.scale, enable_gqa=gqa
            )  # [B, H, 1, D]
            return o.reshape(q.shape[0], -1)
        assert isinstance(meta, _PrefillMeta)
        out = torch.empty_like(q)
        for i, start in enumerate(meta.starts):
            n = batch.q_lens[i]
            slots = batch.kv_slots[i]
            kk = kbuf[slots].transpose(0, 1)[None].to(q.dtype)  # [1, Hkv, L, D]
            vv = vbuf[slots].transpose(0, 1)[None].to(q.dtype)
            qq = q[start : start + n].transpose(0, 1)[None]  # [1, H, n, D]
            mask = meta.masks[i]
            o = F.scaled_dot_product_attention(
                qq, kk, vv, attn_mask=mask, scale=self.scale, enable_gqa=gqa
            )
            out[start : start + n] = o[0].transpose(0, 1)
        return out.reshape(q.shape[0], -1)
