"""Attention backends by name: `torch` (CPU and GPU) and `flashinfer` (GPU, extra `gpu`)."""

from __future__ import annotations

from engine.attention.base import AttentionBackend, ForwardBatch
from engine.attention.torch_backend import TorchAttentionBackend
from hicache.errors import ConfigError
from hicache.pools import DeviceKVPool

ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")


def make_attention_backend(
    name: str, pool: DeviceKVPool, num_heads: int, head_dim: int, scale: float
) -> AttentionBackend:
    """`auto` is `torch` everywhere until the flashinfer kernels are wired."""
    if name in ("auto", "torch"):
        return TorchAttentionBackend(pool, num_heads, head_dim, scale)
    if name == "flashinfer":
        from engine.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(pool, num_heads, head_dim, scale)
    raise ConfigError(f"unknown attention_backend {name!r}; known: {', '.join(ATTENTION_BACKENDS)}")


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "ForwardBatch", "make_attention_backend"]
