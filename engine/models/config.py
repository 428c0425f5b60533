"""`ModelConfig`: the parts of a Hugging Face `config.json` our decoders need.

Reads both the transformers 4.x layout (`rope_theta`, `rope_scaling`) and the 5.x layout
(`rope_parameters`). Llama-family checkpoints (llama, mistral, qwen2, qwen3) and DeepSeek-V2/V3
ones (multi-head latent attention, MoE: `deepseek_v2`, `deepseek_v3`). `KVSpec` is what one
tensor-parallel rank keeps in its KV pool; `kv_bytes_per_token` sizes that pool.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from hicache_client.errors import ConfigError
from hicache_client.units import kv_bytes_per_token as _kv_bytes

# model_type -> (q/k/v bias by default, q/k RMSNorm)
SUPPORTED_MODEL_TYPES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
MLA_ROPE_TYPES = ("default", "yarn")
# DeepSeek-V2's expert selection (softmax scores); V3 always takes sigmoid scores with the
# e_score_correction_bias and group-limited selection ("noaux_tc"), as transformers does.
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


class KVSpec(NamedTuple):
    """What one tensor-parallel rank keeps in its KV pool and hands its attention backend."""

    num_layers: int
    kv_heads: int  # KV heads in this rank's pool (1 for MLA: one latent per token)
    head_dim: int  # width of a pool row and of q/k in the backend (MLA: kv_lora + rope dims)
    v_head_dim: int  # width of V and of the attention output per head (MLA: kv_lora_rank)
    num_heads: int  # query heads on this rank
    scale: float  # softmax scale
    mla: bool  # the pool holds one latent per token (V = its first `v_head_dim` dims)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # {"rope_type": ..., "factor": ..., ...} without rope_theta; empty = plain RoPE.
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama's attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Sliding-window attention span (Mistral; Qwen2 with use_sliding_window). We attend over the
    # whole context, which is exact while the context is no longer than the window.
    sliding_window: int | None = None
    # -- DeepSeek-V2/V3 (model_type deepseek_v2 / deepseek_v3); zero for the Llama family --
    kv_lora_rank: int = 0  # width of the compressed KV latent (0: not MLA)
    q_lora_rank: int | None = None  # q through q_a_proj / q_a_layernorm / q_b_proj when set
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0  # also `head_dim` (the rotary width), as in transformers
    v_head_dim: int = 0
    rope_interleave: bool = True  # rotary dims in interleaved pairs (V2 always; V3 default)
    first_k_dense_replace: int = 0  # the first k layers are dense MLPs, the rest MoE
    n_routed_experts: int = 0  # 0: no MoE layer
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    num_experts_per_tok: int = 0
    topk_method: str = "greedy"  # V2 only (V3 is always noaux_tc)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False  # V3 only (transformers' V2 router ignores it)
    routed_scaling_factor: float = 1.0

    @property
    def rope_type(self) -> str:
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3): one latent per token in the pool."""
        return self.kv_lora_rank > 0

    def kv_spec(self, tp_size: int = 1) -> KVSpec:
        """One rank's pool and attention shape under `tp_size`-way tensor parallelism (the
        divisibility checks are the model's: see `engine.models.parallel`)."""
        heads = self.num_heads // tp_size
        if self.is_mla:
            d = self.kv_lora_rank + self.qk_rope_head_dim
            return KVSpec(self.num_layers, 1, d, self.kv_lora_rank, heads,
                          mla_softmax_scale(self), True)
        kv = max(1, self.num_kv_heads // tp_size)  # fewer KV heads than ranks: replicated
        return KVSpec(self.num_layers, kv, self.head_dim, self.head_dim, heads,
                      self.head_dim**-0.5, False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        mtype = d.get("model_type", "llama")
        if mtype in MLA_MODEL_TYPES:
            return _deepseek_config(cls, d)
        if mtype not in SUPPORTED_MODEL_TYPES:
            known = ", ".join([*SUPPORTED_MODEL_TYPES, *MLA_MODEL_TYPES])
            raise ConfigError(f"unsupported model_type {mtype!r}; supported: {known}")
        default_bias, qk_norm = SUPPORTED_MODEL_TYPES[mtype]
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported hidden_act {d.get('hidden_act')!r} (only silu)")
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
        rtype = rope.get("rope_type", rope.get("type", "default"))
        if rtype not in ROPE_TYPES:
            raise ConfigError(f"unsupported rope type {rtype!r}; supported: {', '.join(ROPE_TYPES)}")
        if rtype == "default":
            rope = {}
        attn_bias = bool(d.get("attention_bias", False))
        window = d.get("sliding_window")
        if mtype == "qwen2" and not d.get("use_sliding_window", False):
            window = None
        if mtype in ("llama", "qwen3") and not d.get("use_sliding_window", False):
            window = None
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=mtype,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=default_bias or attn_bias,
            o_bias=attn_bias and mtype != "qwen2",
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=qk_norm,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
            sliding_window=int(window) if window else None,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"no config.json in {path}")
        return cls.from_dict(json.loads(cfg_path.read_text()))


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int, tp_size: int = 1) -> int:
    """KV bytes one token takes in one rank's pool: K and V of this rank's KV heads per layer
    (replicated when there are fewer KV heads than ranks), or one latent per layer for MLA
    (the same on every rank)."""
    spec = cfg.kv_spec(tp_size)
    return _kv_bytes(spec.num_layers, spec.kv_heads, spec.head_dim, itemsize, mla=spec.mla)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """The softmax scale of DeepSeek attention: `(qk_nope + qk_rope) ** -0.5`, times
    `yarn_get_mscale(factor, mscale_all_dim) ** 2` under a scaled RoPE with `mscale_all_dim`."""
    scale = float((cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5)
    rs = cfg.rope_scaling
    if rs and rs.get("mscale_all_dim"):
        m = yarn_get_mscale(float(yarn_factor(cfg)), float(rs["mscale_all_dim"]))
        scale = scale * m * m
    return scale


def yarn_factor(cfg: ModelConfig) -> float:
    """YaRN's `factor`; when the config leaves it out, max_position_embeddings over the
    original window (as transformers' `_compute_yarn_parameters`)."""
    rs = cfg.rope_scaling
    if rs.get("factor") is not None:
        return float(rs["factor"])
    return cfg.max_position_embeddings / float(
        rs.get("original_max_position_embeddings") or cfg.max_position_embeddings
    )


def _rope_params(d: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
    return theta, rope


def _deepseek_config(cls: type[ModelConfig], d: dict[str, Any]) -> ModelConfig:
    """DeepSeek-V2/V3 fields, read as transformers 5.24's DeepseekV2Config / DeepseekV3Config
    read them (their defaults where a key is missing)."""
    mtype = d["model_type"]
    v3 = mtype == "deepseek_v3"

    def get(key: str, v2_default: Any, v3_default: Any) -> Any:
        value = d.get(key, v3_default if v3 else v2_default)
        return (v3_default if v3 else v2_default) if value is None else value

    if d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported hidden_act {d.get('hidden_act')!r} (only silu)")
    if d.get("quantization_config"):
        # DeepSeek-V3's own release is block-wise FP8 (weights with `weight_scale_inv`).
        raise ConfigError(f"quantized {mtype} checkpoints are not supported (use a bf16 copy)")
    theta, rope = _rope_params(d)
    rtype = rope.get("rope_type", rope.get("type", "default"))
    if rtype not in MLA_ROPE_TYPES:
        raise ConfigError(
            f"unsupported rope type {rtype!r} for {mtype}; supported: {', '.join(MLA_ROPE_TYPES)}"
        )
    rope = {} if rtype == "default" else {**rope, "rope_type": rtype}
    topk_method = "noaux_tc" if v3 else str(get("topk_method", "greedy", "greedy"))
    if not v3 and topk_method not in V2_TOPK_METHODS:
        raise ConfigError(f"unsupported topk_method {topk_method!r} for deepseek_v2; supported: "
                          f"{', '.join(V2_TOPK_METHODS)}")
    layers = int(d["num_hidden_layers"])
    experts = int(get("n_routed_experts", 64, 256))
    dense = int(get("first_k_dense_replace", 0, 3))
    top_k = int(get("num_experts_per_tok", 0, 8))
    n_group, topk_group = int(get("n_group", 1, 8)), int(get("topk_group", 1, 4))
    if dense < layers:  # MoE layers exist
        if not 0 < top_k <= experts:
            raise ConfigError(f"num_experts_per_tok {top_k} must be in 1..{experts}")
        grouped = v3 or topk_method == "group_limited_greedy"
        per_group = experts // n_group if experts % n_group == 0 else 0
        if grouped and (per_group < (2 if v3 else 1) or not 0 < topk_group <= n_group):
            raise ConfigError(f"{experts} routed experts, n_group {n_group} and topk_group "
                              f"{topk_group} do not make expert groups")
    rope_dim = int(get("qk_rope_head_dim", 64, 64))
    q_lora = d.get("q_lora_rank", 1536)
    eos = d.get("eos_token_id", 1 if v3 else 2)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    bias = bool(d.get("attention_bias", False))
    return cls(
        model_type=mtype,
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=layers,
        num_heads=int(d["num_attention_heads"]),
        num_kv_heads=1,  # one latent per token
        head_dim=rope_dim,
        rms_norm_eps=float(get("rms_norm_eps", 1e-6, 1e-6)),
        rope_theta=theta,
        rope_scaling=rope,
        max_position_embeddings=int(get("max_position_embeddings", 2048, 4096)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=bias,  # q_a_proj and kv_a_proj_with_mqa
        o_bias=bias,
        mlp_bias=False if v3 else bool(d.get("mlp_bias", False)),
        torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
        eos_token_ids=eos_ids,
        bos_token_id=d.get("bos_token_id"),
        kv_lora_rank=int(get("kv_lora_rank", 512, 512)),
        q_lora_rank=None if q_lora is None else int(q_lora),
        qk_nope_head_dim=int(get("qk_nope_head_dim", 128, 128)),
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(get("v_head_dim", 128, 128)),
        rope_interleave=bool(get("rope_interleave", True, True)) if v3 else True,
        first_k_dense_replace=dense,
        n_routed_experts=experts,
        n_shared_experts=int(get("n_shared_experts", 2, 1)),
        moe_intermediate_size=int(get("moe_intermediate_size", 1407, 2048)),
        num_experts_per_tok=top_k,
        topk_method=topk_method,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=bool(get("norm_topk_prob", False, True)) if v3 else False,
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0, 2.5)),
    )
