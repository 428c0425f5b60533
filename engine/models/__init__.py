"""Llama-family decoders over the paged KV pool, and the checkpoint loader."""

from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_model, model_fingerprint

__all__ = ["LlamaForCausalLM", "ModelConfig", "load_model", "model_fingerprint"]
