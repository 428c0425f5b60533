"""CUDA graphs for the decode step (CUDA + an attention backend that supports them: `triton`).

A decode forward of `bs` requests is captured once per size of a ladder (1, 2, 4, ... 64, then
steps of 64, up to `cuda_graph_max_bs`) over static input buffers; a step of `n` requests is
replayed from the smallest captured size `>= n`, the rows past `n` padded. The page table is an
input like the tokens: the graph stays valid however HiCache moves or frees pages.

Padding rows write their K/V nowhere (slot -1, skipped by the backend's store) and attend one
position of page 0 (read-only); their logits are dropped. Larger batches, prefill/extend batches
and batches with a `wait_layer` hook run eagerly.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

import torch

from engine.attention.base import AttentionBackend, ForwardBatch

logger = logging.getLogger(__name__)

LADDER_BASE = (1, 2, 4, 8, 16, 32, 64)
LADDER_STEP = 64


def batch_size_ladder(max_bs: int) -> list[int]:
    """Captured batch sizes: powers of two up to 64, then multiples of 64, and `max_bs`."""
    if max_bs < 1:
        return []
    sizes = [b for b in LADDER_BASE if b <= max_bs]
    sizes += list(range(LADDER_BASE[-1] + LADDER_STEP, max_bs + 1, LADDER_STEP))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def padded_batch_size(ladder: Sequence[int], bs: int) -> int | None:
    """The smallest captured size that holds `bs` requests (None: larger than any)."""
    i = bisect.bisect_left(ladder, bs)
    return ladder[i] if i < len(ladder) else None


class DecodeGraphInputs:
    """The static input buffers of the captured decode graphs (any device: tested on CPU).

    `fill(batch, bs)` copies a decode batch into the first rows and pads rows up to `bs`;
    `batch(bs)` is the `ForwardBatch` over the first `bs` rows that a graph is captured with.
    """

    def __init__(self, max_bs: int, max_pages: int, page_size: int, device: torch.device) -> None:
        self.max_bs, self.max_pages, self.page_size = max_bs, max_pages, page_size

        def i64(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        def i32(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=device)

        self.input_ids = i64(max_bs)
        self.positions = i64(max_bs)
        self.out_slots = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.page_table = i32(max_bs, max_pages)
        self.kv_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.q_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.q_starts = torch.arange(max_bs + 1, dtype=torch.int32, device=device)

    def fits(self, batch: ForwardBatch) -> bool:
        return (
            batch.is_decode
            and batch.batch_size <= self.max_bs
            and batch.page_table.shape[1] <= self.max_pages
        )

    def fill(self, batch: ForwardBatch, bs: int) -> None:
        n, p = batch.batch_size, batch.page_table.shape[1]
        assert self.fits(batch) and n <= bs <= self.max_bs
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.out_slots[:n].copy_(batch.out_slots)
        self.kv_lens[:n].copy_(batch.kv_lens_t)
        # Columns past p may hold stale pages: never read, each row reads ceil(kv_len / ps).
        self.page_table[:n, :p].copy_(batch.page_table)
        if bs > n:
            self.input_ids[n:bs] = 0
            self.positions[n:bs] = 0
            self.out_slots[n:bs] = -1
            self.kv_lens[n:bs] = 1
            self.page_table[n:bs, 0] = 0

    def batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_slots=self.out_slots[:bs], page_table=self.page_table[:bs],
            q_lens_t=self.q_lens[:bs], kv_lens_t=self.kv_lens[:bs],
            q_starts=self.q_starts[: bs + 1], page_size=self.page_size,
            q_lens=[1] * bs, kv_lens=[1] * bs, logits_rows=None,
        )


class CudaGraphRunner:
    """Captures `model`'s decode forward for every ladder size; `replay(batch)` runs one."""

    def __init__(
        self,
        model: torch.nn.Module,
        attn: AttentionBackend,
        *,
        max_bs: int,
        max_pages: int,
        device: torch.device,
    ) -> None:
        if device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if not attn.supports_cuda_graph:
            raise ValueError(f"attention backend {attn.name!r} cannot be captured")
        self.model, self.attn = model, attn
        self.ladder = batch_size_ladder(max_bs)
        self.inputs = DecodeGraphInputs(max_bs, max_pages, attn.pool.page_size, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # decode steps served from a graph
        self._capture(device)

    def _capture(self, device: torch.device) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        # Largest first: smaller graphs reuse its memory pool.
        for bs in reversed(self.ladder):
            batch = self.inputs.batch(bs)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up (Triton compiles, allocators settle)
                    self.model(batch, self.attn)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # Captured on the warm-up stream (as SGLang and vLLM do): per-stream state set up by
            # the warm-up (the cuBLAS workspace) is the one the capture uses.
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[bs] = self.model(batch, self.attn)
            self.graphs[bs] = graph
        torch.cuda.synchronize(device)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.ladder)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.wait_layer is None and self.inputs.fits(batch)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[batch_size, vocab]` of a decode batch (`can_run(batch)` must hold); a view of
        the graph's output buffer, valid until the next replay."""
        n = batch.batch_size
        bs = padded_batch_size(self.ladder, n)
        assert bs is not None
        self.inputs.fill(batch, bs)
        self.graphs[bs].replay()
        self.replays += 1
        return self.outputs[bs][:n]
