"""`ModelConfig`: the parts of a Hugging Face `config.json` the Llama-family decoder needs.

Reads both the transformers 4.x layout (`rope_theta`, `rope_scaling`) and the 5.x layout
(`rope_parameters`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache.errors import ConfigError

# model_type -> (q/k/v bias by default, q/k RMSNorm)
SUPPORTED_MODEL_TYPES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


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

    @property
    def rope_type(self) -> str:
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        mtype = d.get("model_type", "llama")
        if mtype not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {mtype!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
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
