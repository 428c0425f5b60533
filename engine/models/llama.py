"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged `DeviceKVPool`.

Parameter names mirror the Hugging Face checkpoints (`model.layers.N.self_attn.q_proj.weight`...)
so weights load by name. Differences between the families are config flags: q/k/v bias (Qwen2),
per-head q/k RMSNorm (Qwen3), tied embeddings, RoPE scaling.

Tensor parallelism (`engine.models.parallel`): q/k/v and gate/up are column-parallel by heads and
columns, o_proj and down_proj row-parallel (all-reduce, then their bias); with fewer KV heads than
ranks each rank keeps the KV head its query heads use. Embedding and lm_head are
vocabulary-parallel; the logits are gathered, so every rank returns the whole vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, ForwardBatch
from engine.distributed import TPGroup
from engine.models.config import KVSpec, ModelConfig
from engine.models.parallel import (
    ParallelLMHead,
    Piece,
    RowParallelLinear,
    TPModel,
    VocabParallelEmbedding,
    kv_head_share,
    rows,
    split,
    vocab_piece,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(cfg: ModelConfig, context_length: int) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with the config's scaling applied.

    `dynamic` (NTK) scaling is applied statically for `context_length` when that exceeds the
    original window (a cached prefix must keep one rotation per position); within the window it is
    plain RoPE, as in transformers.
    """
    dim = cfg.head_dim
    theta = cfg.rope_theta
    rs = cfg.rope_scaling
    rtype = cfg.rope_type
    if rtype == "dynamic":
        factor = float(rs["factor"])
        orig = int(rs.get("original_max_position_embeddings", cfg.max_position_embeddings))
        if context_length > orig:
            theta = theta * ((factor * context_length / orig) - (factor - 1)) ** (dim / (dim - 2))
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rtype == "linear":
        inv = inv / float(rs["factor"])
    elif rtype == "llama3":
        factor = float(rs["factor"])
        low = float(rs["low_freq_factor"])
        high = float(rs["high_freq_factor"])
        old = float(rs["original_max_position_embeddings"])
        low_wl, high_wl = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv = torch.where(medium, smoothed, scaled)
    return inv


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, cfg: ModelConfig, context_length: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", rope_inv_freq(cfg, context_length), persistent=False)

    def reset_buffers(self, context_length: int) -> None:
        """Recompute the frequencies (float32) where the buffer lives (after `to_empty`)."""
        self.inv_freq = rope_inv_freq(self.cfg, context_length).to(self.inv_freq.device)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[T, 1, D]` of `positions`, computed in float32 and cast once to `dtype`
        (the activations'), as transformers does: every layer then uses them as they are."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        if dtype is not None:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D] in x's dtype (`RotaryEmbedding`: no cast here, in
    every layer)."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.layer = layer
        heads = split(cfg.num_heads, tp, "num_attention_heads")
        kv = kv_head_share(cfg.num_heads, cfg.num_kv_heads, tp)
        self.num_heads = heads.stop - heads.start
        self.num_kv_heads = kv.stop - kv.start
        self.head_dim = cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.num_heads * d, h, cfg.o_bias, tp)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        # Checkpoint rows of this rank's q and k/v heads, and how many rows there are.
        self.shards = {"q": (rows(heads, d), cfg.num_heads * d),
                       "kv": (rows(kv, d), cfg.num_kv_heads * d)}

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        return self.o_proj(attn.forward(self.layer, q, k, v, batch))


class MLP(nn.Module):
    """SwiGLU; gate/up column-parallel, down row-parallel over `intermediate` columns."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.share = split(intermediate, tp, "intermediate_size")
        self.full = intermediate
        i = self.share.stop - self.share.start
        self.gate_proj = nn.Linear(hidden, i, bias=bias)
        self.up_proj = nn.Linear(hidden, i, bias=bias)
        self.down_proj = RowParallelLinear(i, hidden, bias, tp)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output (no reduce, no down bias)."""
        return self.down_proj.partial(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def piece(self, prefix: str, leaf: str) -> Piece:
        """Where `{prefix}.{leaf}` (e.g. `gate_proj.weight`) of the checkpoint goes."""
        name = f"{prefix}.{leaf}"
        if leaf in ("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias"):
            return Piece(name, 0, self.share, self.full)
        if leaf == "down_proj.weight":
            return Piece(name, 1, self.share, self.full)
        return Piece(name)  # down_proj.bias: whole, added after the reduce


class PreNormBlock(nn.Module):
    """A decoder layer's wiring (Llama and DeepSeek alike): pre-norm attention and MLP, each
    added to the residual stream. Subclasses build `self_attn`, `mlp` and the two norms."""

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderLayer(PreNormBlock):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, tp)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, context_length: int, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg, context_length)


class LlamaForCausalLM(TPModel):
    """`forward(batch, attn) -> logits [rows, vocab]` (float32) for `batch.logits_rows`; under
    tensor parallelism this rank's shard, returning the whole vocabulary's logits."""

    def __init__(
        self, cfg: ModelConfig, context_length: int | None = None, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or TPGroup.solo()
        self.model = Backbone(cfg, context_length or cfg.max_position_embeddings, tp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        self.kv_spec: KVSpec = cfg.kv_spec(tp.size)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def load_piece(self, name: str) -> Piece | None:
        cfg, tp = self.config, self.tp
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            return None  # the embedding's
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return vocab_piece(name, cfg.vocab_size, tp)
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or len(parts) < 5 or not parts[2].isdigit():
            return Piece(name)  # final norm; unknown names fail on lookup
        i = int(parts[2])
        if i >= cfg.num_layers:
            return Piece(name)
        module, leaf = parts[3], ".".join(parts[4:])
        layer = self.model.layers[i]
        if module == "mlp":
            return layer.mlp.piece(f"model.layers.{i}.mlp", leaf)
        if module == "self_attn":
            shards = layer.self_attn.shards
            proj = leaf.split(".")[0]
            if proj == "q_proj":
                return Piece(name, 0, *shards["q"])
            if proj in ("k_proj", "v_proj"):
                return Piece(name, 0, *shards["kv"])
            if leaf == "o_proj.weight":
                return Piece(name, 1, *shards["q"])
        return Piece(name)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        attn.prepare(batch)
        x = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.model.rotary_emb(batch.positions, x.dtype)
        wait = batch.wait_layer
        for i, layer in enumerate(self.model.layers):
            if wait is not None:
                wait(i)  # layer i's K/V (loaded back layer by layer) must be in the pool
            x = layer(x, cos, sin, batch, attn)
        if batch.logits_rows is not None:
            x = x[batch.logits_rows]
        x = self.model.norm(x)
        return self.lm_head(x).float()
