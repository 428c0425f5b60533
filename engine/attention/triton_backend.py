"""`triton` attention: paged decode and ragged extend kernels reading K/V straight from the pool.

One store launch plus one attention launch per layer (two for decode: split-K and its
reduction), whatever the batch size; no K/V gather, no per-request loop. Over an MLA pool the
kernels store the latent alone and read V as the latent's first `v_head_dim` dims (queries are
`[latent-space nope part | rope part]`, scored against `[kv_c | k_pe]`). A decode forward reads
only tensors (page table, lengths), so it can be captured in a CUDA graph
(`engine/cuda_graph.py`). On CPU the kernels run under Triton's interpreter, which must be on
before triton is imported (`TRITON_INTERPRET=1`): that is how the tests check the kernels
against the `torch` backend; it is far too slow to serve with.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, ForwardBatch
from hicache.pools import DeviceKVPool
from hicache_client.errors import ConfigError


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class _DecodeMeta:
    mid_o: torch.Tensor  # [B, H, splits, D] float32 partial outputs
    mid_lse: torch.Tensor  # [B, H, splits] float32 their log-sum-exp


@dataclass
class _ExtendMeta:
    max_q_len: int
    # Split-KV scratch (None: one program per request, head and query block walks all keys).
    mid_o: torch.Tensor | None = None  # [T, H, splits, D] float32 partial outputs
    mid_lse: torch.Tensor | None = None  # [T, H, splits] float32 their log-sum-exp


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True

    def __init__(
        self,
        pool: DeviceKVPool,
        num_heads: int,
        head_dim: int,
        scale: float,
        v_head_dim: int | None = None,
        num_splits: int | None = None,
        extend_splits: int | None = None,
    ) -> None:
        super().__init__(pool, num_heads, head_dim, scale, v_head_dim)
        if not triton_available():
            raise ConfigError("attention_backend 'triton' needs the triton package")
        if pool.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(
                "attention_backend 'triton' on CPU runs only under TRITON_INTERPRET=1 "
                "(for tests; use 'torch' to serve on CPU)"
            )
        if num_heads % pool.kv_heads:
            raise ConfigError(f"{num_heads} query heads are not a multiple of "
                              f"{pool.kv_heads} KV heads")
        from engine.attention import triton_kernels

        self.k = triton_kernels
        cuda = pool.device.type == "cuda"
        # Split-K of decode: enough programs to fill a GPU at small batch sizes.
        self.num_splits = num_splits or (8 if cuda else 2)
        # Split-KV of an extend (None: `triton_kernels.extend_splits` decides per batch).
        self.extend_splits = extend_splits
        # Extend tiles; small under the interpreter so the tests cross tile borders, and for
        # float32 heads over 64 on CUDA (64-row float32 K and V tiles of 128-wide heads, three
        # pipeline stages deep, come close to an SM's shared memory; unmeasured), and smaller
        # still for MLA's 512-wide latents (as SGLang's MLA extend; unmeasured here).
        wide_fp32 = pool.dtype == torch.float32 and head_dim > 64
        self.block = 64 if cuda and not wide_fp32 else 32
        if cuda and self.v_head_dim > 128:
            self.block = 16

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.is_decode:
            b, h, d, s = batch.batch_size, self.num_heads, self.v_head_dim, self.num_splits
            dev = self.pool.device
            batch.meta = _DecodeMeta(
                torch.empty((b, h, s, d), dtype=torch.float32, device=dev),
                torch.empty((b, h, s), dtype=torch.float32, device=dev),
            )
        else:
            h, d, dev = self.num_heads, self.v_head_dim, self.pool.device
            programs = batch.batch_size * h * -(-batch.max_q_len // self.block)
            splits = self.extend_splits or self.k.extend_splits(programs, max(batch.kv_lens), dev)
            meta = _ExtendMeta(batch.max_q_len)
            if splits > 1:
                t = batch.num_tokens
                meta.mid_o = torch.empty((t, h, splits, d), dtype=torch.float32, device=dev)
                meta.mid_lse = torch.empty((t, h, splits), dtype=torch.float32, device=dev)
            batch.meta = meta

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        pool = self.pool
        kbuf, vbuf = pool.k_buffer[layer], pool.v_buffer[layer]
        q, k = q.contiguous(), k.contiguous()
        if pool.mla:
            if v is not None:
                raise ValueError("an MLA pool takes the latent alone")
            self.k.store_kv(k, None, kbuf, None, batch.out_slots)
        else:
            assert v is not None
            self.k.store_kv(k, v.contiguous(), kbuf, vbuf, batch.out_slots)
        out = q.new_empty(q.shape[0], q.shape[1], self.v_head_dim)
        meta = batch.meta
        if isinstance(meta, _DecodeMeta):
            self.k.decode_attention(
                q, kbuf, vbuf, batch.page_table, batch.kv_lens_t, pool.page_size, self.scale,
                meta.mid_o, meta.mid_lse, out, v_from_k=pool.mla,
            )
        else:
            assert isinstance(meta, _ExtendMeta)
            self.k.extend_attention(
                q, kbuf, vbuf, batch.page_table, batch.q_starts, batch.q_lens_t, batch.kv_lens_t,
                meta.max_q_len, pool.page_size, self.scale, out, self.block, self.block,
                v_from_k=pool.mla, mid_o=meta.mid_o, mid_lse=meta.mid_lse,
            )
        return out.reshape(q.shape[0], -1)


def triton_self_check(
    pool: DeviceKVPool, num_heads: int, head_dim: int, scale: float,
    v_head_dim: int | None = None,
) -> str | None:
    """Run the triton backend once against the torch backend on small pools shaped like `pool`
    (its page size, KV heads or MLA latent, head sizes, dtype and device): an extend batch over
    a cached prefix, then a decode batch. None when the outputs agree, else what went wrong (a
    kernel that does not compile on this GPU, or wrong results)."""
    from engine.attention.torch_backend import TorchAttentionBackend

    ps, dev, dtype = pool.page_size, pool.device, pool.dtype
    per = -(-40 // ps)  # pages of a 40-token request
    try:
        pools = [
            DeviceKVPool(num_pages=2 * per + 1, page_size=ps, num_layers=1,
                         kv_heads=pool.kv_heads, head_dim=head_dim, dtype=dtype, device=dev,
                         mla=pool.mla)
            for _ in range(2)
        ]
        g = torch.Generator(device=dev).manual_seed(0)
        init = torch.randn(pools[0].kv.shape, generator=g, device=dev, dtype=dtype)
        for p in pools:
            p.kv.copy_(init)
        backends: list[AttentionBackend] = [
            TorchAttentionBackend(pools[0], num_heads, head_dim, scale, v_head_dim),
            TritonAttentionBackend(pools[1], num_heads, head_dim, scale, v_head_dim),
        ]
        tables = [list(range(1, 1 + per)), list(range(1 + per, 1 + 2 * per))]
        steps = (
            [([0] * 24, 16, tables[0]), ([0] * 5, 0, tables[1])],  # extend over a prefix
            [([0], 39, tables[0]), ([0], 20, tables[1])],  # decode
        )
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        for seqs in steps:
            t = sum(len(s[0]) for s in seqs)
            q = torch.randn(t, num_heads, head_dim, generator=g, device=dev, dtype=dtype)
            k = torch.randn(t, pool.kv_heads, head_dim, generator=g, device=dev, dtype=dtype)
            v = None if pool.mla else torch.randn(t, pool.kv_heads, head_dim, generator=g,
                                                  device=dev, dtype=dtype)
            outs = []
            for p, b in zip(pools, backends):
                batch = ForwardBatch.build(p, seqs)
                b.prepare(batch)
                outs.append(b.forward(0, q, k, v, batch).float())
            err = (outs[0] - outs[1]).abs().max().item()
            if not err <= tol:  # NaN fails too
                kind = "decode" if batch.is_decode else "extend"
                return f"{kind} output differs from the torch backend by {err:.3g}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None
