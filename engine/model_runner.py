"""`ModelRunner`: the model, its device KV pool and the attention backend, one forward per step.

`forward(seqs)` takes any mix of requests: several requests' prefill/extend chunks (ragged, each
over its own cached prefix) and decode tokens run in one forward, one attention launch per layer
with the `triton` backend. On CUDA with a backend that supports it, a decode step is replayed
from a CUDA graph (`engine/cuda_graph.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from engine.attention import ForwardBatch, make_attention_backend
from engine.attention.base import Seq
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
        cuda_graph_max_bs: int = 0,
        context_length: int | None = None,
    ) -> None:
        """`cuda_graph_max_bs`: capture decode graphs up to this batch size (0: none; used only
        on CUDA with a backend that supports graphs). `context_length` bounds the graphs' page
        table width (default: the model's max_position_embeddings)."""
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
            "device KV pool: %d pages x %d tokens (%.1f MiB), attention backend %s",
            num_pages, page_size, self.pool.kv.numel() * self.pool.kv.element_size() / 2**20,
            self.attn.name,
        )
        self.graph_runner = None
        self.cuda_graph_error: str | None = None  # why the capture failed (decode runs eagerly)
        if cuda_graph_max_bs > 0 and device.type == "cuda" and self.attn.supports_cuda_graph:
            from engine.cuda_graph import CudaGraphRunner

            ctx = context_length or cfg.max_position_embeddings
            try:
                self.graph_runner = CudaGraphRunner(
                    model, self.attn, max_bs=cuda_graph_max_bs,
                    max_pages=min(-(-ctx // page_size), num_pages), device=device,
                )
            except Exception as e:  # eager decode is the same computation, only slower
                self.cuda_graph_error = f"{type(e).__name__}: {e}"
                logger.exception("CUDA graph capture failed; decode steps run eagerly")

    def forward(
        self,
        seqs: Sequence[Seq],
        last_only: bool = True,
        wait_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """`seqs`: per request `(new_token_ids, start_position, page_table)`, any number of
        requests and new tokens each. Returns float32 logits, one row per request
        (`last_only`) or per token. `wait_layer(i)` is called before layer i reads the pool."""
        batch = ForwardBatch.build(self.pool, seqs, last_only=last_only, wait_layer=wait_layer)
        return self.forward_batch(batch)

    def forward_batch(self, batch: ForwardBatch) -> torch.Tensor:
        gr = self.graph_runner
        if gr is not None and gr.can_run(batch):
            return gr.replay(batch)
        return self.model(batch, self.attn)
