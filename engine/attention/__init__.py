"""Attention backends by name: `torch` (SDPA, CPU and GPU) and `triton` (paged kernels, GPU).

`auto` is `triton` on CUDA when triton imports and the backend passes a self-check against
`torch` on that device, else `torch`. There is no `flashinfer` backend:
it could not be installed or tested on any machine of the project (see docs/engine.md).
"""

from __future__ import annotations

import logging

from engine.attention.base import AttentionBackend, ForwardBatch
from engine.attention.torch_backend import TorchAttentionBackend
from hicache.pools import DeviceKVPool
from hicache_client.errors import ConfigError

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "torch", "triton")


def resolve_attention_backend(name: str, device_type: str) -> str:
    """The backend `name` stands for on a device of `device_type` (`auto` resolved)."""
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"unknown attention_backend {name!r}; known: {', '.join(ATTENTION_BACKENDS)}"
        )
    if name != "auto":
        return name
    from engine.attention.triton_backend import triton_available

    return "triton" if device_type == "cuda" and triton_available() else "torch"


def make_attention_backend(
    name: str,
    pool: DeviceKVPool,
    num_heads: int,
    head_dim: int,
    scale: float,
    v_head_dim: int | None = None,
) -> AttentionBackend:
    """`auto` takes `triton` only when it passes a self-check against `torch` on this device
    (small pools of `pool`'s shape, MLA or not); else it warns and takes `torch`.
    `v_head_dim`: the width of V (an MLA pool's V is that prefix of the latent)."""
    requested = name
    name = resolve_attention_backend(name, pool.device.type)
    if name == "triton" and requested == "auto":
        from engine.attention.triton_backend import triton_self_check

        err = triton_self_check(pool, num_heads, head_dim, scale, v_head_dim)
        if err is not None:
            logger.warning("attention_backend auto: triton failed its self-check (%s); "
                           "using torch", err)
            name = "torch"
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(pool, num_heads, head_dim, scale, v_head_dim)
    return TorchAttentionBackend(pool, num_heads, head_dim, scale, v_head_dim)


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "ForwardBatch",
    "make_attention_backend",
    "resolve_attention_backend",
]
