"""`flashinfer` attention: the GPU path (extra `gpu`).

Selected only when CUDA is present and `flashinfer` imports. The paged kernels are not wired yet:
constructing the backend raises a clear error so `--attention-backend flashinfer` never runs a
half-finished path; `auto` falls back to `torch`, which runs on GPU as well.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, ForwardBatch
from hicache.errors import ConfigError


def flashinfer_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, *args: object, **kwargs: object) -> None:
        if not flashinfer_available():
            raise ConfigError("attention_backend 'flashinfer' needs CUDA and the flashinfer package")
        raise ConfigError(
            "attention_backend 'flashinfer' is not implemented yet; use 'torch' (runs on GPU too)"
        )

    def prepare(self, batch: ForwardBatch) -> None:  # pragma: no cover - unreachable
        raise NotImplementedError

    def forward(self, layer, q, k, v, batch):  # type: ignore[no-untyped-def]  # pragma: no cover
        raise NotImplementedError
