"""Triton kernels of the `triton` attention backend: paged K/V store, decode and extend.

Modelled on SGLang's triton attention backend (decode_attention.py, extend_attention.py), written
for our pool: K/V of one layer are `[slots, kv_heads, head_dim]`, a request's slots are reached
through its row of the padded int32 page table (`slot = page * PAGE + pos % PAGE`).

- `store_kv`: the new tokens' K and V (or an MLA latent alone) into their slots, one launch; a
  slot of -1 is skipped (the padding rows of a CUDA-graph batch).
- `decode_attention`: one query token per request, GQA-grouped (up to 16 query heads of one KV
  head share every K/V load and use `tl.dot`), split-K over the sequence (`num_splits` partial
  results with their log-sum-exp), then a reduction kernel: two launches per layer.
- `extend_attention`: a ragged batch of new tokens over cached prefixes, causal within the new
  tokens and full over the prefix; one launch per layer, grid (request, head, query block).

Q and K rows are `[main | pe]`: V is as wide as the main part. For MHA/GQA the main part is the
whole head (`pe_dim` 0) and V comes from the V buffer; for MLA (`v_from_k`) K is the latent
`[kv_c | k_pe]` and V is its `kv_c` part, read once for both (as SGLang's MLA kernels do): the
scores are `q_main . kv_c + q_pe . k_pe`.

Every kernel reads lengths and page ids from tensors only, so a decode step can be captured in
a CUDA graph. On CPU they run under Triton's interpreter (`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Only `triton.language` builtins below, no functions of its standard library (`tl.max`,
# `tl.sum`, `tl.zeros`, `tl.cdiv` are themselves `@triton.jit` functions): those are decorated
# when triton is first imported, and if that import happened before TRITON_INTERPRET=1 was set
# (transformers imports triton) they cannot run inside an interpreted kernel.


@triton.jit
def _fmax(a, b):
    return tl.maximum(a, b)


@triton.jit
def _fadd(a, b):
    return a + b


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dimension >= 16


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 must stay float32 (TF32 would change greedy outputs vs the torch backend).
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _store_kv_kernel(
    K, V, KBuf, VBuf, Slots,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_bt, stride_bh,
    HKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_V: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(Slots + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    valid = (offs_h[:, None] * 0 + slot) >= 0  # the slot's sign, as a block
    mask = (offs_h[:, None] < HKV) & (offs_d[None, :] < HEAD_DIM) & valid
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    dst = slot * stride_bt + offs_h[:, None] * stride_bh + offs_d[None, :]
    tl.store(KBuf + dst, k.to(KBuf.dtype.element_ty), mask=mask)
    if HAS_V:
        v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        tl.store(VBuf + dst, v.to(VBuf.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor | None,
    kbuf: torch.Tensor,
    vbuf: torch.Tensor | None,
    slots: torch.Tensor,
) -> None:
    """`kbuf[slots[t]] = k[t]` (and V; an MLA latent has none) for every `t` with
    `slots[t] >= 0`."""
    t, hkv, d = k.shape
    if t == 0:
        return
    has_v = v is not None and vbuf is not None
    vv, vb = (v, vbuf) if has_v else (k, kbuf)
    _store_kv_kernel[(t,)](
        k, vv, kbuf, vb, slots,
        k.stride(0), k.stride(1), vv.stride(0), vv.stride(1), kbuf.stride(0), kbuf.stride(1),
        HKV=hkv, HEAD_DIM=d, BLOCK_H=triton.next_power_of_2(hkv),
        BLOCK_D=_block_d(d), HAS_V=has_v,
    )


@triton.jit
def _kv_block(
    Row, n0, end, head_off, stride_bt, offs_d, mask_d, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """KV tokens n0 .. n0 + BLOCK_N - 1 (those < end) of one request, whose page-table row
    starts at `Row`: their positions, mask, the element offset of each token's row in the paged
    K/V buffers (head at `head_off`), the offsets of its main part (`offs_d`) and their mask."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    page = tl.load(Row + offs_n // PAGE, mask=mask_n, other=0)
    slot = page.to(tl.int64) * PAGE + offs_n % PAGE
    base = slot * stride_bt + head_off
    kv_off = base[:, None] + offs_d[None, :]
    kv_mask = mask_n[:, None] & mask_d[None, :]
    return offs_n, mask_n, base, kv_off, kv_mask


@triton.jit
def _scores(q, q_pe, KBuf, base, kv_off, kv_mask, mask_n, offs_pe, DIM: tl.constexpr,
            PE_DIM: tl.constexpr, HAS_PE: tl.constexpr, DOT_PREC: tl.constexpr):
    """`q . k` of a block of keys (main part, plus the `pe` part after `DIM` when `HAS_PE`),
    unscaled, and the keys' main part (an MLA latent's `kv_c`, which is also its V)."""
    k = tl.load(KBuf + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if HAS_PE:
        pe_off = base[:, None] + DIM + offs_pe[None, :]
        pe_mask = mask_n[:, None] & (offs_pe[None, :] < PE_DIM)
        k_pe = tl.load(KBuf + pe_off, mask=pe_mask, other=0.0).to(q.dtype)
        qk += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PREC)
    return qk, k


@triton.jit
def _softmax_step(qk, v, m_i, l_i, acc, DOT_PREC: tl.constexpr):
    """One online-softmax step: fold the masked scores `qk` and their V rows `v` into the
    running max `m_i`, denominator `l_i` and weighted sum `acc`; the new three."""
    m_new = tl.maximum(m_i, tl.reduce(qk, 1, _fmax))
    # A row that has seen no visible key yet (all -inf: a split of an extend's prefix past its
    # causal limit) stays empty instead of turning NaN (-inf - -inf).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(qk - m_safe[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    l_i = l_i * alpha + tl.reduce(p, 1, _fadd)
    return m_new, l_i, acc


@triton.jit
def _attend(q, q_pe, KBuf, VBuf, Row, lo, hi, last, kv_head_off, stride_bt, offs_d, mask_d,
            offs_pe, sm_scale, ROWS: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, PE_DIM: tl.constexpr,
            HAS_PE: tl.constexpr, V_FROM_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """Online softmax of `ROWS` query rows over keys `lo .. hi - 1` of one request (its page
    table row at `Row`), row r seeing keys up to `last[r]` (causal); the running max,
    denominator and weighted sum of V. A row that sees none of them stays empty."""
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.full([ROWS], 0.0, dtype=tl.float32)
    acc = tl.full([ROWS, BLOCK_D], 0.0, dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n, mask_n, base, kv_off, kv_mask = _kv_block(
            Row, n0, hi, kv_head_off, stride_bt, offs_d, mask_d, PAGE, BLOCK_N)
        qk, k = _scores(q, q_pe, KBuf, base, kv_off, kv_mask, mask_n, offs_pe, HEAD_DIM,
                        PE_DIM, HAS_PE, DOT_PREC)
        ok = mask_n[None, :] & (offs_n[None, :] <= last[:, None])
        qk = tl.where(ok, qk * sm_scale, float("-inf"))  # [ROWS, BLOCK_N]
        if V_FROM_K:
            v = k
        else:
            v = tl.load(VBuf + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        m_i, l_i, acc = _softmax_step(qk, v, m_i, l_i, acc, DOT_PREC)
    return m_i, l_i, acc


@triton.jit
def _decode_stage1(
    Q, KBuf, VBuf, PageTable, KvLens, MidO, MidLse, sm_scale,
    stride_qt, stride_qh, stride_bt, stride_bh, stride_pt,
    stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, PE_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_PE: tl.constexpr,
    HAS_PE: tl.constexpr, V_FROM_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1) // HEAD_BLOCKS
    hblk = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)
    offs_h = hblk * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_pe = tl.arange(0, BLOCK_PE)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h
    q_row = Q + b * stride_qt + heads[:, None] * stride_qh
    q = tl.load(q_row + offs_d[None, :], mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    q_pe = tl.load(q_row + HEAD_DIM + offs_pe[None, :],
                   mask=mask_h[:, None] & (offs_pe[None, :] < PE_DIM), other=0.0)
    kv_len = tl.load(KvLens + b)
    split_len = (kv_len + NUM_SPLITS - 1) // NUM_SPLITS
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)
    last = tl.full([BLOCK_H], 0, dtype=tl.int32) + kv_len - 1  # every key is visible
    m_i, l_i, acc = _attend(
        q, q_pe, KBuf, VBuf, PageTable + b * stride_pt, start, end, last, kvh * stride_bh,
        stride_bt, offs_d, mask_d, offs_pe, sm_scale, BLOCK_H, PAGE, BLOCK_N, BLOCK_D,
        HEAD_DIM, PE_DIM, HAS_PE, V_FROM_K, DOT_PREC)
    has = l_i > 0.0  # an empty split (short sequence) reports -inf and a zero partial
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    mo = MidO + b * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s
    tl.store(mo + offs_d[None, :], out, mask=mask_h[:, None] & mask_d[None, :])
    tl.store(MidLse + b * stride_ml_b + heads * stride_ml_h + split, lse, mask=mask_h)


@triton.jit
def _decode_stage2(
    MidO, MidLse, Out,
    stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    # Split 0 is never empty (kv_len >= 1), so the running max is finite from the first step.
    m = tl.full([1], float("-inf"), dtype=tl.float32)
    den = tl.full([1], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_D], 0.0, dtype=tl.float32)
    for s in range(NUM_SPLITS):
        lse = tl.load(MidLse + b * stride_ml_b + h * stride_ml_h + s + tl.full([1], 0, dtype=tl.int32))
        o = tl.load(MidO + b * stride_mo_b + h * stride_mo_h + s * stride_mo_s + offs_d,
                    mask=mask_d, other=0.0)
        m_new = tl.maximum(m, lse)
        old = tl.exp(m - m_new)
        w = tl.exp(lse - m_new)
        acc = acc * old + w * o
        den = den * old + w
        m = m_new
    tl.store(Out + b * stride_ot + h * stride_oh + offs_d, (acc / den).to(Out.dtype.element_ty),
             mask=mask_d)


def _pe(q_dim: int, v_dim: int) -> dict[str, int | bool]:
    """The `[main | pe]` split of q/k rows whose main part is as wide as V."""
    pe = q_dim - v_dim
    return {"PE_DIM": pe, "BLOCK_PE": _block_d(pe) if pe else 16, "HAS_PE": pe > 0}


def decode_attention(
    q: torch.Tensor,  # [B, H, Dk]
    kbuf: torch.Tensor,  # [slots, Hkv, Dk]
    vbuf: torch.Tensor,  # [slots, Hkv, Dv] (MLA: unused, V is kbuf[..., :Dv])
    page_table: torch.Tensor,  # [B, P] int32
    kv_lens: torch.Tensor,  # [B] int32
    page_size: int,
    scale: float,
    mid_o: torch.Tensor,  # [B, H, num_splits, Dv] float32 scratch
    mid_lse: torch.Tensor,  # [B, H, num_splits] float32 scratch
    out: torch.Tensor,  # [B, H, Dv]
    block_n: int = 32,
    v_from_k: bool = False,
) -> None:
    b, h, dk = q.shape
    dv = out.shape[2]
    hkv = kbuf.shape[1]
    group = h // hkv
    splits = mid_lse.shape[2]
    block_h = 16  # query heads of one KV head per program (more: several programs)
    head_blocks = triton.cdiv(group, block_h)
    _decode_stage1[(b, hkv * head_blocks, splits)](
        q, kbuf, vbuf, page_table, kv_lens, mid_o, mid_lse, scale,
        q.stride(0), q.stride(1), kbuf.stride(0), kbuf.stride(1), page_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_BLOCKS=head_blocks, PAGE=page_size, NUM_SPLITS=splits, HEAD_DIM=dv,
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=_block_d(dv), V_FROM_K=v_from_k,
        DOT_PREC=_dot_precision(q.dtype), **_pe(dk, dv),
    )
    _decode_stage2[(b, h)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=splits, HEAD_DIM=dv, BLOCK_D=_block_d(dv),
    )


@triton.jit
def _extend_kernel(
    Q, KBuf, VBuf, Out, PageTable, QStarts, QLens, KvLens, MidO, MidLse, sm_scale,
    stride_qt, stride_qh, stride_bt, stride_bh, stride_ot, stride_oh, stride_pt,
    stride_mo_t, stride_mo_h, stride_mo_s, stride_ml_t, stride_ml_h,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, PE_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_PE: tl.constexpr,
    HAS_PE: tl.constexpr, V_FROM_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    kvh = h // GROUP
    q_len = tl.load(QLens + b)
    q_start = tl.load(QStarts + b)
    kv_len = tl.load(KvLens + b)
    prefix = kv_len - q_len
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_pe = tl.arange(0, BLOCK_PE)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q_row = Q + rows[:, None] * stride_qt + h * stride_qh
    q = tl.load(q_row + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    q_pe = tl.load(q_row + HEAD_DIM + offs_pe[None, :],
                   mask=mask_m[:, None] & (offs_pe[None, :] < PE_DIM), other=0.0)
    # Keys up to the block's last query (causal); none for a block past this request's tokens.
    end = tl.minimum(kv_len, prefix + (mblk + 1) * BLOCK_M)
    end = tl.where(mblk * BLOCK_M < q_len, end, 0)
    # Split-KV: this program takes one of NUM_SPLITS equal runs of those keys (whole key
    # blocks); the runs' partial results are merged by `_decode_stage2`, one program a row.
    split_len = tl.cdiv(tl.cdiv(end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, end)
    # Key 0 is visible to every row: a row's first split always has a finite max; a later
    # split past a row's causal limit leaves it empty (`_softmax_step`).
    m_i, l_i, acc = _attend(
        q, q_pe, KBuf, VBuf, PageTable + b * stride_pt, lo, hi, prefix + offs_m,
        kvh * stride_bh, stride_bt, offs_d, mask_d, offs_pe, sm_scale, BLOCK_M, PAGE, BLOCK_N,
        BLOCK_D, HEAD_DIM, PE_DIM, HAS_PE, V_FROM_K, DOT_PREC)
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    mask_o = mask_m[:, None] & mask_d[None, :]
    if NUM_SPLITS == 1:
        tl.store(Out + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=mask_o)
    else:
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        mo = MidO + rows[:, None] * stride_mo_t + h * stride_mo_h + split * stride_mo_s
        tl.store(mo + offs_d[None, :], out, mask=mask_o)
        tl.store(MidLse + rows * stride_ml_t + h * stride_ml_h + split, lse, mask=mask_m)


# Split-KV of an extend: each split takes at least this many keys (fewer: one program walks
# them as fast as a merge would cost).
MIN_SPLIT_KEYS = 256
MAX_EXTEND_SPLITS = 16


def extend_splits(programs: int, max_kv_len: int, device: torch.device) -> int:
    """How many runs to split an extend's keys into: enough programs to fill the GPU twice
    over when one program per (request, head, query block) would leave it idle (a short extend
    over a long cached prefix), never a run under MIN_SPLIT_KEYS keys. 1 on CPU."""
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-target // max(1, programs))
    return max(1, min(want, max_kv_len // MIN_SPLIT_KEYS, MAX_EXTEND_SPLITS))


def extend_attention(
    q: torch.Tensor,  # [T, H, Dk]
    kbuf: torch.Tensor,  # [slots, Hkv, Dk]
    vbuf: torch.Tensor,  # [slots, Hkv, Dv] (MLA: unused, V is kbuf[..., :Dv])
    page_table: torch.Tensor,  # [B, P] int32
    q_starts: torch.Tensor,  # [B + 1] int32
    q_lens: torch.Tensor,  # [B] int32
    kv_lens: torch.Tensor,  # [B] int32
    max_q_len: int,
    page_size: int,
    scale: float,
    out: torch.Tensor,  # [T, H, Dv]
    block_m: int = 32,
    block_n: int = 32,
    v_from_k: bool = False,
    mid_o: torch.Tensor | None = None,  # [T, H, splits, Dv] float32: split-KV partial outputs
    mid_lse: torch.Tensor | None = None,  # [T, H, splits] float32
) -> None:
    """Causal attention of each request's new rows over its cached prefix and themselves.
    With `mid_o`/`mid_lse` of `splits` > 1, each (request, head, query block) is split into
    `splits` runs of keys on as many programs, merged after (split-KV)."""
    t, h, dk = q.shape
    dv = out.shape[2]
    b = q_lens.shape[0]
    hkv = kbuf.shape[1]
    splits = 1 if mid_lse is None else mid_lse.shape[2]
    mo = mid_o if mid_o is not None and splits > 1 else out.new_empty((1, 1, 1, 1))
    ml = mid_lse if mid_lse is not None and splits > 1 else out.new_empty((1, 1, 1))
    _extend_kernel[(b, h, triton.cdiv(max_q_len, block_m) * splits)](
        q, kbuf, vbuf, out, page_table, q_starts, q_lens, kv_lens, mo, ml, scale,
        q.stride(0), q.stride(1), kbuf.stride(0), kbuf.stride(1), out.stride(0), out.stride(1),
        page_table.stride(0), mo.stride(0), mo.stride(1), mo.stride(2), ml.stride(0),
        ml.stride(1),
        GROUP=h // hkv, PAGE=page_size, HEAD_DIM=dv, NUM_SPLITS=splits, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=_block_d(dv), V_FROM_K=v_from_k,
        DOT_PREC=_dot_precision(q.dtype), **_pe(dk, dv),
    )
    if splits > 1:
        _decode_stage2[(t, h)](
            mo, ml, out,
            mo.stride(0), mo.stride(1), mo.stride(2), ml.stride(0), ml.stride(1),
            out.stride(0), out.stride(1),
            NUM_SPLITS=splits, HEAD_DIM=dv, BLOCK_D=_block_d(dv),
        )
