"""Our decoders over the paged KV pool (Llama family; DeepSeek-V2/V3 with MLA and MoE), their
tensor-parallel sharding, and the checkpoint loader."""

from engine.models.config import KVSpec, ModelConfig, kv_bytes_per_token
from engine.models.deepseek import DeepseekForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_model, model_fingerprint
from engine.models.parallel import TPModel

__all__ = [
    "DeepseekForCausalLM",
    "KVSpec",
    "LlamaForCausalLM",
    "ModelConfig",
    "TPModel",
    "kv_bytes_per_token",
    "load_model",
    "model_fingerprint",
]
