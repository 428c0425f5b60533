"""DeepSeek-V2 / V3 (`deepseek_v2`, `deepseek_v3`): multi-head latent attention and MoE over a
paged pool that holds ONE latent per token and layer.

Computed as transformers 5.24's DeepseekV2ForCausalLM / DeepseekV3ForCausalLM compute it
(their code is the test oracle), with the attention rewritten around the latent:

- q: `q_proj`, or `q_a_proj -> q_a_layernorm -> q_b_proj` (q_lora_rank set); per head
  `[q_nope (qk_nope_head_dim) | q_pe (qk_rope_head_dim)]`.
- The latent: `kv_a_proj_with_mqa -> [kv_c | k_pe]`, `kv_c` through `kv_a_layernorm`, `k_pe`
  rotated; the pool stores `[kv_c | k_pe]` (kv_lora_rank + qk_rope_head_dim), nothing per head.
- Weight absorption: `kv_b_proj` is per head `[W_UK (qk_nope) ; W_UV (v_head_dim)] x kv_lora`.
  `q_nope @ W_UK` moves the query into latent space, attention is MQA over the latent
  (scores `[q_nope W_UK | q_pe] . [kv_c | k_pe]`, values `kv_c`), and the output goes through
  `W_UV` then `o_proj`. Equal to expanding K/V per head, without ever storing them.
- RoPE: default or YaRN (inverse frequencies, `attention_factor` on cos/sin, softmax scale
  times `mscale(factor, mscale_all_dim)**2`), interleaved pairs (V2; V3 unless
  `rope_interleave` is false).
- MLP: dense for the first `first_k_dense_replace` layers, then MoE: routed experts plus shared
  experts. V2: softmax scores, `greedy` or `group_limited_greedy`, times
  `routed_scaling_factor` (no renormalisation: transformers' V2 router ignores
  `norm_topk_prob`). V3: sigmoid scores, `e_score_correction_bias` for the choice only, best
  `topk_group` of `n_group` groups (a group's score: its top-2 sum), optional renormalisation,
  times `routed_scaling_factor`. Router weights stay float32.

Tensor parallelism: heads are sharded (q projections, `kv_b_proj`'s per-head W_UK/W_UV, `o_proj`
row-parallel + all-reduce); the latent path (`kv_a_proj_with_mqa`, `kv_a_layernorm`, `q_a_*`) is
replicated, so every rank writes the same latent (one copy in L3 serves all ranks). Dense and
shared MLPs and every expert split their intermediate columns; the MoE layer makes one
all-reduce of routed + shared partial sums. Routing runs on every rank on identical inputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, ForwardBatch
from engine.distributed import TPGroup
from engine.models.config import KVSpec, ModelConfig, yarn_factor, yarn_get_mscale
from engine.models.llama import MLP, PreNormBlock, RMSNorm
from engine.models.parallel import (
    ParallelLMHead,
    Piece,
    RowParallelLinear,
    TPModel,
    VocabParallelEmbedding,
    rows,
    split,
    vocab_piece,
)
from hicache_client.errors import ConfigError

_LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers' RMSNorm default


def mla_rope(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, `qk_rope_head_dim / 2`) and the factor on cos/sin, as
    transformers' default and `_compute_yarn_parameters` compute them."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if cfg.rope_type != "yarn":
        return 1.0 / pos_freqs, 1.0
    rs = cfg.rope_scaling
    factor = yarn_factor(cfg)
    orig = int(rs.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention_factor)


class MLARotary(nn.Module):
    """cos/sin `[T, rope_dim / 2]` (times the YaRN attention factor) of the positions."""

    inv_freq: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        inv, self.attention_factor = mla_rope(cfg)
        self.register_buffer("inv_freq", inv, persistent=False)

    def reset_buffers(self, context_length: int) -> None:
        self.inv_freq = mla_rope(self.cfg)[0].to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


def apply_mla_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """x: `[T, heads, rope_dim]`. Interleaved pairs `(x0, x1), (x2, x3)...` come out as
    `[evens' | odds']` (transformers' V3 layout; V2 keeps pairs interleaved: the same dot
    products, as q and k share the layout)."""
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.layer = layer
        heads = split(cfg.num_heads, tp, "num_attention_heads")
        self.num_heads = h = heads.stop - heads.start
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.c = cfg.kv_lora_rank
        self.interleave = cfg.rope_interleave
        hidden, qk = cfg.hidden_size, self.dn + self.dr
        self.q_lora = cfg.q_lora_rank is not None
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.c + self.dr, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.c, _LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.c, h * (self.dn + self.dv), bias=False)
        self.o_proj = RowParallelLinear(h * self.dv, hidden, cfg.o_bias, tp)
        # Checkpoint rows of this rank's heads in q / kv_b_proj, and o_proj's columns.
        n = cfg.num_heads
        self.shards = {"q": (rows(heads, qk), n * qk),
                       "kv_b": (rows(heads, self.dn + self.dv), n * (self.dn + self.dv)),
                       "o": (rows(heads, self.dv), n * self.dv)}

    def piece(self, name: str, leaf: str) -> Piece:
        proj = leaf.split(".")[0]
        if proj in ("q_proj", "q_b_proj"):
            return Piece(name, 0, *self.shards["q"])
        if proj == "kv_b_proj":
            return Piece(name, 0, *self.shards["kv_b"])
        if leaf == "o_proj.weight":
            return Piece(name, 1, *self.shards["o"])
        return Piece(name)  # the replicated latent path, o_proj's bias

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> torch.Tensor:
        t, h, dn, c = x.shape[0], self.num_heads, self.dn, self.c
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_nope, q_pe = q.view(t, h, dn + self.dr).split([dn, self.dr], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([c, self.dr], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        q_pe = apply_mla_rope(q_pe, cos, sin, self.interleave)
        k_pe = apply_mla_rope(k_pe[:, None, :], cos, sin, self.interleave)
        latent = torch.cat([kv_c[:, None, :], k_pe], dim=-1)  # [T, 1, c + dr]
        w = self.kv_b_proj.weight.view(h, dn + self.dv, c)
        w_uk, w_uv = w[:, :dn], w[:, dn:]  # [h, dn, c], [h, dv, c]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, h, c]
        qf = torch.cat([q_lat, q_pe], dim=-1)  # [T, h, c + dr]
        o = attn.forward(self.layer, qf, latent, None, batch).view(t, h, c)
        out = torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, h, dv]
        return self.o_proj(out.reshape(t, h * self.dv))


class Router(nn.Module):
    """The gate: (weights `[T, k]` float32, expert ids `[T, k]`) of each token."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e = cfg.n_routed_experts
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(e, cfg.hidden_size))
        self.v3 = cfg.model_type == "deepseek_v3"
        if self.v3:
            self.e_score_correction_bias = nn.Parameter(torch.empty(e))

    def _group_mask(self, scores: torch.Tensor, group_scores: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, idx, 1)
        per = cfg.n_routed_experts // cfg.n_group
        return mask.unsqueeze(-1).expand(-1, cfg.n_group, per).reshape(-1, cfg.n_routed_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        k, g = cfg.num_experts_per_tok, cfg.n_group
        logits = F.linear(x.float(), self.weight.float())
        if self.v3:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            groups = choice.view(-1, g, cfg.n_routed_experts // g).topk(2, dim=-1)[0].sum(dim=-1)
            choice = choice.masked_fill(~self._group_mask(scores, groups).bool(), float("-inf"))
            idx = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, idx)
            if cfg.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            scores = logits.softmax(dim=-1, dtype=torch.float32)
            if cfg.topk_method == "group_limited_greedy":
                groups = scores.view(-1, g, cfg.n_routed_experts // g).max(dim=-1).values
                scores = scores.masked_fill(~self._group_mask(scores, groups).bool(), 0.0)
            weights, idx = torch.topk(scores, k=k, dim=-1, sorted=False)
        return weights * cfg.routed_scaling_factor, idx


class Experts(nn.Module):
    """Routed experts stacked: `gate_up_proj [E, 2 * i, hidden]`, `down_proj [E, hidden, i]`
    (`i`: this rank's intermediate columns). `forward` returns this rank's partial sums."""

    def __init__(self, num: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.num, self.inter = num, inter
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, inter))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        k = idx.shape[1]
        out = torch.zeros_like(x)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # NOTE: one host sync per MoE layer (tokens per expert); no CUDA graph for MoE models.
        counts = torch.bincount(flat, minlength=self.num).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start : start + n]
            start += n
            tok, slot = sel // k, sel % k
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[tok, slot, None]
            out.index_add_(0, tok, h.to(out.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.share = split(cfg.moe_intermediate_size, tp, "moe_intermediate_size")
        self.full = cfg.moe_intermediate_size
        self.gate = Router(cfg)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size,
                               self.share.stop - self.share.start)
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = (
            MLP(cfg.hidden_size, shared, cfg.mlp_bias, tp) if shared else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = self.gate(x)
        y = self.experts(x, weights, idx)
        if self.shared_experts is None:
            return self.tp.all_reduce(y)
        return self.shared_experts.down_proj.finish(y + self.shared_experts.partial(x))

    def piece(self, prefix: str, leaf: str) -> Piece:
        parts = leaf.split(".")
        if parts[0] == "gate":
            return Piece(f"{prefix}.{leaf}")
        if parts[0] == "shared_experts" and self.shared_experts is not None:
            return self.shared_experts.piece(f"{prefix}.shared_experts", ".".join(parts[1:]))
        if parts[0] == "experts" and len(parts) == 4 and parts[1].isdigit():
            e, i, full = int(parts[1]), self.experts.inter, self.full
            if e >= self.experts.num or parts[3] != "weight":
                raise ConfigError(f"unexpected expert tensor {prefix}.{leaf}")
            name = f"{prefix}.experts.gate_up_proj"
            if parts[2] == "gate_proj":
                return Piece(name, 0, self.share, full, (e, slice(0, i)))
            if parts[2] == "up_proj":
                return Piece(name, 0, self.share, full, (e, slice(i, 2 * i)))
            if parts[2] == "down_proj":
                return Piece(f"{prefix}.experts.down_proj", 1, self.share, full, (e,))
        if parts[0] == "experts":
            raise ConfigError(f"expert tensor {prefix}.{leaf} is not in the per-expert layout "
                              "(experts.N.{gate,up,down}_proj.weight) that we load")
        return Piece(f"{prefix}.{leaf}")


class DecoderLayer(PreNormBlock):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = MLAttention(cfg, layer, tp)
        self.mlp: MLP | MoE
        if layer >= cfg.first_k_dense_replace:
            self.mlp = MoE(cfg, tp)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = MLARotary(cfg)


class DeepseekForCausalLM(TPModel):
    """`forward(batch, attn) -> logits [rows, vocab]` (float32); the pool must be an MLA pool
    (`kv_spec.mla`: one `[kv_c | k_pe]` latent per token and layer)."""

    keep_fp32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")

    def __init__(
        self, cfg: ModelConfig, context_length: int | None = None, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        if not cfg.is_mla:
            raise ConfigError(f"{cfg.model_type} is not a DeepSeek (MLA) config")
        self.config = cfg
        self.tp = tp = tp or TPGroup.solo()
        self.model = Backbone(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        self.kv_spec: KVSpec = cfg.kv_spec(tp.size)
        # The experts' per-layer host sync cannot be captured in a CUDA graph.
        self.supports_cuda_graph = cfg.first_k_dense_replace >= cfg.num_layers

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def param_pieces(self, param: str) -> int:
        e = self.config.n_routed_experts
        if param.endswith("experts.gate_up_proj"):
            return 2 * e
        return e if param.endswith("experts.down_proj") else 1

    def load_piece(self, name: str) -> Piece | None:
        cfg = self.config
        if name.endswith("rotary_emb.inv_freq"):
            return None
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            return None
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return vocab_piece(name, cfg.vocab_size, self.tp)
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or len(parts) < 5 or not parts[2].isdigit():
            return Piece(name)
        i = int(parts[2])
        if i >= cfg.num_layers:
            return None  # DeepSeek-V3's multi-token-prediction layers (not used)
        layer = self.model.layers[i]
        prefix, module, leaf = f"model.layers.{i}.{parts[3]}", parts[3], ".".join(parts[4:])
        if module == "self_attn":
            return layer.self_attn.piece(name, leaf)
        if module == "mlp":
            return layer.mlp.piece(prefix, leaf)
        return Piece(name)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        attn.prepare(batch)
        x = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.model.rotary_emb(batch.positions)
        wait = batch.wait_layer
        for i, layer in enumerate(self.model.layers):
            if wait is not None:
                wait(i)  # layer i's latents (loaded back layer by layer) must be in the pool
            x = layer(x, cos, sin, batch, attn)
        if batch.logits_rows is not None:
            x = x[batch.logits_rows]
        x = self.model.norm(x)
        return self.lm_head(x).float()
