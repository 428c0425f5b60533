"""`hicache-hitrate --model NAME`: KV bytes per token of the open models people serve.

Each entry is the attention shape from the model's published Hugging Face `config.json` (the
repository named in `source`): layers, KV heads and head dim (GQA/MHA), or `kv_lora_rank` +
`qk_rope_head_dim` (multi-head latent attention, DeepSeek-V2/V3 and their descendants), and the
sliding window and how many layers use it (Gemma 2/3, gpt-oss).

How bytes are counted (docs/hitrate.md says the same):

- GQA/MHA: K and V per layer, per KV head on the rank, `head_dim` elements each. Under `tp`-way
  tensor parallelism each rank keeps `kv_heads / tp` heads; with fewer KV heads than ranks each
  rank keeps one (the heads are replicated), as the engine's pool does
  (`engine.models.config.ModelConfig.kv_spec`).
- MLA: one latent of `kv_lora_rank + qk_rope_head_dim` elements per layer, the same on every
  rank (replicated, not divided by `tp`).
- Sliding-window layers are counted like full ones: a HiCache page holds every layer's KV of its
  tokens, so a cached prefix of any length is complete. `full_attention_bytes` gives the part of
  the full-attention layers alone, the floor an SWA-aware cache reaches on prefixes much longer
  than the window.
- dtype: bf16 2 bytes, fp8 1, fp4 0.5 per element (block scales not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache_client.errors import ConfigError

KV_DTYPE_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp4": 0.5}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str  # the Hugging Face repository whose config.json the numbers come from
    layers: int
    kv_heads: int = 0  # GQA/MHA: num_key_value_heads (0 for MLA)
    head_dim: int = 0
    kv_lora_rank: int = 0  # MLA: width of the compressed latent (0: not MLA)
    qk_rope_head_dim: int = 0  # MLA: the rotary part kept beside the latent
    sliding_window: int | None = None  # tokens a sliding-window layer attends over
    sliding_layers: int = 0  # how many of `layers` use the window

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def full_layers(self) -> int:
        return self.layers - self.sliding_layers

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one rank keeps under `tp`-way tensor parallelism (1 for MLA's latent)."""
        if tp < 1:
            raise ConfigError(f"--tp must be >= 1, got {tp}")
        if self.mla:
            return 1
        if self.kv_heads >= tp:
            if self.kv_heads % tp:
                raise ConfigError(
                    f"{self.name}: {self.kv_heads} KV heads do not split over --tp {tp}"
                )
            return self.kv_heads // tp
        if tp % self.kv_heads:
            raise ConfigError(
                f"{self.name}: {self.kv_heads} KV heads cannot be replicated evenly over --tp {tp}"
            )
        return 1

    def elements_per_layer(self, tp: int = 1) -> int:
        """KV elements one token takes in one layer on one rank."""
        if self.mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.kv_heads_per_rank(tp) * self.head_dim

    def bytes_per_token(self, kv_dtype: str = "bf16", tp: int = 1) -> float:
        """KV bytes one token takes on one rank, every layer counted."""
        return self.layers * self.elements_per_layer(tp) * dtype_bytes(kv_dtype)

    def full_attention_bytes(self, kv_dtype: str = "bf16", tp: int = 1) -> float:
        """The full-attention layers' part of `bytes_per_token` (all of it without a window)."""
        return self.full_layers * self.elements_per_layer(tp) * dtype_bytes(kv_dtype)


def dtype_bytes(kv_dtype: str) -> float:
    try:
        return KV_DTYPE_BYTES[kv_dtype]
    except KeyError:
        raise ConfigError(
            f"unknown --kv-dtype {kv_dtype!r} for --model; known: {', '.join(KV_DTYPE_BYTES)}"
        ) from None


def _gqa(name: str, source: str, layers: int, kv_heads: int, head_dim: int) -> ModelSpec:
    return ModelSpec(name, source, layers, kv_heads, head_dim)


def _mla(name: str, source: str, layers: int) -> ModelSpec:
    # Every DeepSeek-V2/V3-architecture checkpoint here has kv_lora_rank 512, qk_rope_head_dim 64.
    return ModelSpec(name, source, layers, kv_lora_rank=512, qk_rope_head_dim=64)


def _swa(
    name: str, source: str, layers: int, kv_heads: int, head_dim: int, window: int, sliding: int
) -> ModelSpec:
    return ModelSpec(name, source, layers, kv_heads, head_dim, 0, 0, window, sliding)


# Gemma 2 alternates local and global layers (half sliding); Gemma 3 has five local layers to
# one global (layer i is global when i % 6 == 5); gpt-oss alternates sliding (128) and full.
MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _gqa("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", 32, 8, 128),
        _gqa("llama-3.1-70b", "meta-llama/Llama-3.1-70B-Instruct", 80, 8, 128),
        _gqa("llama-3.1-405b", "meta-llama/Llama-3.1-405B-Instruct", 126, 8, 128),
        _gqa("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", 16, 8, 64),
        _gqa("llama-3.2-3b", "meta-llama/Llama-3.2-3B-Instruct", 28, 8, 128),
        _gqa("llama-3.3-70b", "meta-llama/Llama-3.3-70B-Instruct", 80, 8, 128),
        _gqa("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", 30, 3, 64),
        _gqa("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", 24, 2, 64),
        _gqa("qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B-Instruct", 28, 2, 128),
        _gqa("qwen2.5-3b", "Qwen/Qwen2.5-3B-Instruct", 36, 2, 128),
        _gqa("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", 28, 4, 128),
        _gqa("qwen2.5-14b", "Qwen/Qwen2.5-14B-Instruct", 48, 8, 128),
        _gqa("qwen2.5-32b", "Qwen/Qwen2.5-32B-Instruct", 64, 8, 128),
        _gqa("qwen2.5-72b", "Qwen/Qwen2.5-72B-Instruct", 80, 8, 128),
        _gqa("qwen2.5-coder-32b", "Qwen/Qwen2.5-Coder-32B-Instruct", 64, 8, 128),
        _gqa("qwen3-0.6b", "Qwen/Qwen3-0.6B", 28, 8, 128),
        _gqa("qwen3-1.7b", "Qwen/Qwen3-1.7B", 28, 8, 128),
        _gqa("qwen3-4b", "Qwen/Qwen3-4B", 36, 8, 128),
        _gqa("qwen3-8b", "Qwen/Qwen3-8B", 36, 8, 128),
        _gqa("qwen3-14b", "Qwen/Qwen3-14B", 40, 8, 128),
        _gqa("qwen3-32b", "Qwen/Qwen3-32B", 64, 8, 128),
        _gqa("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", 48, 4, 128),
        _gqa("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", 94, 4, 128),
        _mla("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite", 27),
        _mla("deepseek-v2", "deepseek-ai/DeepSeek-V2", 60),
        _mla("deepseek-v2.5", "deepseek-ai/DeepSeek-V2.5", 60),
        _mla("deepseek-v3", "deepseek-ai/DeepSeek-V3", 61),
        _mla("deepseek-r1", "deepseek-ai/DeepSeek-R1", 61),
        _mla("kimi-k2", "moonshotai/Kimi-K2-Instruct", 61),
        _gqa("mistral-7b-v0.3", "mistralai/Mistral-7B-Instruct-v0.3", 32, 8, 128),
        _gqa("mistral-nemo-12b", "mistralai/Mistral-Nemo-Instruct-2407", 40, 8, 128),
        _gqa("mistral-small-24b", "mistralai/Mistral-Small-24B-Instruct-2501", 40, 8, 128),
        _gqa("mistral-large-2", "mistralai/Mistral-Large-Instruct-2407", 88, 8, 128),
        _gqa("mixtral-8x7b", "mistralai/Mixtral-8x7B-Instruct-v0.1", 32, 8, 128),
        _gqa("mixtral-8x22b", "mistralai/Mixtral-8x22B-Instruct-v0.1", 56, 8, 128),
        _swa("gemma-2-2b", "google/gemma-2-2b-it", 26, 4, 256, 4096, 13),
        _swa("gemma-2-9b", "google/gemma-2-9b-it", 42, 8, 256, 4096, 21),
        _swa("gemma-2-27b", "google/gemma-2-27b-it", 46, 16, 128, 4096, 23),
        _swa("gemma-3-1b", "google/gemma-3-1b-it", 26, 1, 256, 512, 22),
        _swa("gemma-3-4b", "google/gemma-3-4b-it", 34, 4, 256, 1024, 29),
        _swa("gemma-3-12b", "google/gemma-3-12b-it", 48, 8, 256, 1024, 40),
        _swa("gemma-3-27b", "google/gemma-3-27b-it", 62, 16, 128, 1024, 52),
        _swa("gpt-oss-20b", "openai/gpt-oss-20b", 24, 8, 64, 128, 12),
        _swa("gpt-oss-120b", "openai/gpt-oss-120b", 36, 8, 64, 128, 18),
        _gqa("glm-4-9b", "THUDM/glm-4-9b-chat", 40, 2, 128),
        _gqa("glm-4.5-air", "zai-org/GLM-4.5-Air", 46, 8, 128),
        _gqa("glm-4.5", "zai-org/GLM-4.5", 92, 8, 128),
        _gqa("glm-4.6", "zai-org/GLM-4.6", 92, 8, 128),
    )
}


def lookup(name: str) -> ModelSpec:
    """The entry for `name` (case-insensitive); a ConfigError lists the known names."""
    spec = MODELS.get(name.strip().lower())
    if spec is None:
        raise ConfigError(f"unknown --model {name!r}; known: {', '.join(MODELS)}")
    return spec


def kv_bytes_per_token(name: str, kv_dtype: str | None = None, tp: int = 1) -> float:
    """`--model NAME --kv-dtype D --tp N`: KV bytes per token on one rank (default bf16)."""
    return lookup(name).bytes_per_token(kv_dtype or "bf16", tp)
