"""`ModelRunner`: the model, its device KV pool and the attention backend, one forward per step."""

from __future__ import annotations

import logging

import torch

from engine.attention import ForwardBatch, make_attention_backend
from engine.models.llama import LlamaForCausalLM
from hicache.pools import DeviceKVPool

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str = "auto",
    ) -> None:
        cfg = model.config
        self.model = model
        self.config = cfg
        self.device = device
        self.pool = DeviceKVPool(
            num_pages=num_pages,
            page_size=page_size,
            num_layers=cfg.num_layers,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=dtype,
            device=device,
        )
        self.attn = make_attention_backend(
            attention_backend, self.pool, cfg.num_heads, cfg.head_dim, cfg.head_dim**-0.5
        )
        logger.info(
            "device KV pool: %d pages x %d tokens (%.1f MiB)",
            num_pages, page_size, self.pool.kv.numel() * self.pool.kv.element_size() / 2**20,
        )

    def forward(
        self, seqs: list[tuple[list[int], int, list[int]]], last_only: bool = True
    ) -> torch.Tensor:
        """`seqs`: per request `(new_token_ids, start_position, page_table)`. Returns float32
        logits, one row per request (`last_only`) or per token."""
        batch = ForwardBatch.build(self.pool, seqs, last_only=last_only)
        return self.model(batch, self.attn)
