"""`torch` attention: scaled_dot_product_attention over K/V gathered from the pool's pages.

Prefill (any request with more than one new token) runs request by request with an explicit
causal mask offset by the cached prefix; a pure decode batch gathers every request's K/V into one
padded `[B, max_len]` block and runs a single SDPA call with a padding mask. Slots come from the
batch's padded page table (one tensor op per step); the loops run on host-side lengths only.
Over an MLA pool K is the gathered latent and V its first `v_head_dim` dims (one KV head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, ForwardBatch


@dataclass
class _DecodeMeta:
    slots: torch.Tensor  # [B, max_len] (past a request's length: masked)
    mask: torch.Tensor  # [B, 1, 1, max_len] bool, True = attend


@dataclass
class _PrefillMeta:
    starts: list[int]  # first row of each request in the flat batch
    slots: list[torch.Tensor]  # per request: [kv_len] int64 slots of the whole sequence
    # [q_len, kv_len] bool; None when q_len == 1 or without a cached prefix (plain causal).
    masks: list[torch.Tensor | None]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prepare(self, batch: ForwardBatch) -> None:
        dev = self.pool.device
        all_slots = batch.kv_slots()
        if batch.is_decode:
            max_len = max(batch.kv_lens)
            ar = torch.arange(max_len, device=dev)
            mask = (ar[None, :] < batch.kv_lens_t[:, None])[:, None, None, :]
            batch.meta = _DecodeMeta(all_slots[:, :max_len], mask)
            return
        starts: list[int] = []
        slots: list[torch.Tensor] = []
        masks: list[torch.Tensor | None] = []
        row = 0
        for i, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens)):
            starts.append(row)
            row += q_len
            slots.append(all_slots[i, :kv_len])
            if q_len == 1 or q_len == kv_len:
                masks.append(None)
                continue
            qi = torch.arange(q_len, device=dev)[:, None] + (kv_len - q_len)
            kj = torch.arange(kv_len, device=dev)[None, :]
            masks.append(kj <= qi)
        batch.meta = _PrefillMeta(starts, slots, masks)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        pool = self.pool
        pool.set_kv(layer, batch.out_slots, k, v)
        kbuf, vbuf = pool.k_buffer[layer], pool.v_buffer[layer]
        gqa = self.num_heads != pool.kv_heads
        meta = batch.meta
        if isinstance(meta, _DecodeMeta):
            kk = kbuf[meta.slots].transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
            vv = self._values(kk, vbuf, meta.slots)
            o = F.scaled_dot_product_attention(
                q[:, :, None, :], kk, vv, attn_mask=meta.mask, scale=self.scale, enable_gqa=gqa
            )  # [B, H, 1, D]
            return o.reshape(q.shape[0], -1)
        assert isinstance(meta, _PrefillMeta)
        if len(meta.starts) == 1:  # one request: no copy into a shared output
            return self._one(q, kbuf, vbuf, meta.slots[0], meta.masks[0], gqa).reshape(
                q.shape[0], -1
            )
        out = q.new_empty(q.shape[0], q.shape[1], self.v_head_dim)
        for i, start in enumerate(meta.starts):
            n = batch.q_lens[i]
            out[start : start + n] = self._one(
                q[start : start + n], kbuf, vbuf, meta.slots[i], meta.masks[i], gqa
            )
        return out.reshape(q.shape[0], -1)

    def _values(self, kk: torch.Tensor, vbuf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """V laid out as `kk` (`[..., Hkv, L, D]`): the latent's first dims over an MLA pool."""
        if self.pool.mla:
            return kk[..., : self.v_head_dim]
        return vbuf[slots].transpose(-3, -2).to(kk.dtype)

    def _one(
        self,
        q: torch.Tensor,  # [n, H, D]
        kbuf: torch.Tensor,
        vbuf: torch.Tensor,
        slots: torch.Tensor,
        mask: torch.Tensor | None,
        gqa: bool,
    ) -> torch.Tensor:
        kk = kbuf[slots].transpose(0, 1)[None].to(q.dtype)  # [1, Hkv, L, D]
        vv = self._values(kk, vbuf, slots).reshape(1, kk.shape[1], kk.shape[2], -1)
        qq = q.transpose(0, 1)[None]  # [1, H, n, D]
        causal = mask is None and q.shape[0] > 1  # no cached prefix: plain causal
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=causal,
                                           scale=self.scale, enable_gqa=gqa)
        return o[0].transpose(0, 1)
