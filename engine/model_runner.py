"""`ModelRunner`: the model, its device KV pool and the attention backend, one forward per step.

`forward(seqs)` takes any mix of requests: several requests' prefill/extend chunks (ragged, each
over its own cached prefix) and decode tokens run in one forward, one attention launch per layer
with the `triton` backend. On CUDA with a backend that supports it, a decode step is replayed
from a CUDA graph (`engine/cuda_graph.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from engine.attention import ForwardBatch, make_attention_backend
from engine.attention.base import Seq
from engine.models.parallel import TPModel
from hicache.pools import DeviceKVPool

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model: TPModel,
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
        table width (default: the model's max_position_embeddings).

        The pool and the backend take their shape from `model.kv_spec` (this tensor-parallel
        rank's KV heads, or one MLA latent per token). CUDA graphs are not captured for a
        model under tensor parallelism or one that does not support them (MoE)."""
        cfg = model.config
        spec = model.kv_spec
        self.model = model
        self.config = cfg
        self.kv_spec = spec
        self.device = device
        self.pool = DeviceKVPool(
            num_pages=num_pages,
            page_size=page_size,
            num_layers=spec.num_layers,
            kv_heads=spec.kv_heads,
            head_dim=spec.head_dim,
            dtype=dtype,
            device=device,
            mla=spec.mla,
        )
        self.attn = make_attention_backend(
            attention_backend, self.pool, spec.num_heads, spec.head_dim, spec.scale,
            spec.v_head_dim,
        )
        logger.info(
            "device KV pool: %d pages x %d tokens (%.1f MiB), attention backend %s",
            num_pages, page_size, self.pool.kv.numel() * self.pool.kv.element_size() / 2**20,
            self.attn.name,
        )
        self.graph_runner = None
        self.cuda_graph_error: str | None = None  # why the capture failed (decode runs eagerly)
        graphs = model.supports_cuda_graph and model.tp.is_solo
        if (cuda_graph_max_bs > 0 and device.type == "cuda" and self.attn.supports_cuda_graph
                and graphs):
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

    def measure_prefill(self, tokens: int) -> float:
        """Seconds of one forward over `tokens` new tokens (after an untimed one), on pages
        borrowed from the pool and given back: the cost model's start-up calibration. A
        collective under tensor parallelism (every rank calls it)."""
        ps = self.pool.page_size
        pages = self.pool.allocator.alloc(-(-tokens // ps))
        if pages is None:
            raise RuntimeError(f"no room in the KV pool for a {tokens}-token forward")
        vocab = self.config.vocab_size
        ids = [(7 * i + 3) % vocab for i in range(tokens)]
        cuda = self.device.type == "cuda"
        try:
            self.forward([(ids, 0, pages)])  # first-use costs (kernels, allocator) stay out
            if cuda:
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            self.forward([(ids, 0, pages)])
            if cuda:
                torch.cuda.synchronize(self.device)
            return time.perf_counter() - t0
        finally:
            self.pool.allocator.free(pages)

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
