"""Small GGUF files for the loader's tests, written with the `gguf` package as llama.cpp's
converter writes them: Q/K rows permuted (llama), tensors in the block types asked for, the
demo model's byte-level BPE tokenizer and chat template in the metadata."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engine.demo_model import CHAT_TEMPLATE, SPECIAL_TOKENS, ensure_demo_model

# Byte offsets of the float16 super-block scales in the K-quant blocks (QK_K = 256), which
# gguf-py cannot quantize to: their blocks are random bytes with these set to small values.
_K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
             "IQ4_NL": (0,)}  # (one we do not take, for the refusal test)

ARCH: dict[str, int] = {"hidden": 256, "ffn": 512, "layers": 2, "heads": 4, "kv_heads": 2}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute` of Q/K rows (interleave the rotary halves)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _block(rows: int, cols: int, kind: str, rng: np.random.Generator) -> tuple[Any, Any]:
    """A tensor of shape (rows, cols) in block type `kind`: (data, raw_dtype for the writer)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        return (rng.standard_normal((rows, cols)) * cols**-0.5).astype(np.float32), None
    if kind in _K_SCALES:
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
        for off in _K_SCALES[kind]:
            scale = (rng.uniform(0.5, 1.0, (rows, cols // block)) * 2e-3 / cols**0.5)
            raw[..., off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(
                rows, cols // block, 2)
        return raw.reshape(rows, -1), qtype
    w = (rng.standard_normal((rows, cols)) * cols**-0.5).astype(np.float32)
    return gguf.quants.quantize(w, qtype), qtype


def write_gguf(
    out: Path,
    *,
    types: Sequence[str] = ("Q8_0",),
    arch: str = "llama",
    seed: int = 0,
    tied: bool = True,
    tokenizer_model: str | None = "gpt2",
    drop: Sequence[str] = (),
    rope_freqs: bool = False,
    vocab_size: int | None = None,
    **arch_overrides: int,
) -> Path:
    """A random-weight `arch` GGUF at `out`. The linear weights take `types` in turn (so one
    file can hold every block type); norms are F32; `drop` leaves tensors out; `rope_freqs`
    adds llama.cpp's per-dimension RoPE factors."""
    import gguf

    a = {**ARCH, **arch_overrides}
    rng = np.random.default_rng(seed)
    tok = json.loads((ensure_demo_model() / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(a["layers"])
    w.add_context_length(1024)
    w.add_embedding_length(a["hidden"])
    w.add_feed_forward_length(a["ffn"])
    w.add_head_count(a["heads"])
    w.add_head_count_kv(a["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(a["hidden"] // a["heads"])
    w.add_vocab_size(vocab_size or len(tokens))
    if tokenizer_model is not None:
        w.add_tokenizer_model(tokenizer_model)
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
        w.add_token_merges(merges)
        w.add_bos_token_id(tok["model"]["vocab"][SPECIAL_TOKENS[0]])
        w.add_eos_token_id(tok["model"]["vocab"]["<|end|>"])
        w.add_chat_template(CHAT_TEMPLATE)
    kinds = iter(list(types) * 1000)
    head_dim = a["hidden"] // a["heads"]

    def add(name: str, rows: int, cols: int, n_head: int | None = None) -> None:
        if name in drop:
            return
        data, raw = _block(rows, cols, next(kinds), rng)
        if n_head is not None and arch == "llama":  # rows move (whole rows of blocks)
            data = permute(data, n_head)
        if raw is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=raw)

    def norm(name: str, n: int) -> None:
        if name not in drop:
            w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    if rope_freqs:  # llama.cpp's Llama-3.1 RoPE scaling: a factor per rotary pair
        w.add_tensor("rope_freqs.weight", np.ones(head_dim // 2, dtype=np.float32))
    add("token_embd.weight", len(tokens), a["hidden"])
    norm("output_norm.weight", a["hidden"])
    if not tied:
        add("output.weight", len(tokens), a["hidden"])
    for i in range(a["layers"]):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", a["hidden"])
        norm(p + "ffn_norm.weight", a["hidden"])
        add(p + "attn_q.weight", a["heads"] * head_dim, a["hidden"], a["heads"])
        add(p + "attn_k.weight", a["kv_heads"] * head_dim, a["hidden"], a["kv_heads"])
        add(p + "attn_v.weight", a["kv_heads"] * head_dim, a["hidden"])
        add(p + "attn_output.weight", a["hidden"], a["heads"] * head_dim)
        add(p + "ffn_gate.weight", a["ffn"], a["hidden"])
        add(p + "ffn_up.weight", a["ffn"], a["hidden"])
        add(p + "ffn_down.weight", a["hidden"], a["ffn"])
        if arch == "qwen2":
            for b, rows in (("attn_q", a["heads"]), ("attn_k", a["kv_heads"]),
                            ("attn_v", a["kv_heads"])):
                w.add_tensor(f"{p}{b}.bias",
                             (0.1 * rng.standard_normal(rows * head_dim)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
