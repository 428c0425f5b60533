"""The scheduler's batch calls over requests: the prefill forward (recording pending prompt
logprobs on the way) and sampling (recording output logprobs), so `engine.scheduler` reads as
scheduling and `engine.req_logprobs` knows nothing of requests."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from engine.req import Req
from engine.req_logprobs import prefill_rows

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner
    from engine.sampling import Sampler


def forward_prompt_logprobs(
    runner: ModelRunner, seqs: Sequence[Any], batch: Sequence[tuple[Req, int]],
    plan: tuple[list[int], list[int], list[tuple[int, int]]],
    wait_layer: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """One prefill forward that also computes the logits of the prompt positions whose logprobs
    are pending (`plan` from `prefill_rows`); records them on the requests and returns each
    request's last-token logits (one row per request, as `runner.forward` does)."""
    from engine.attention import ForwardBatch

    rows, last, spans = plan
    fb = ForwardBatch.build(runner.pool, seqs)
    fb.logits_rows = torch.tensor(rows, dtype=torch.long, device=fb.input_ids.device)
    fb.wait_layer = wait_layer
    logits = runner.forward_batch(fb)
    for (req, _), (first, n) in zip(batch, spans):
        if n and req.logprobs is not None:
            req.logprobs.record_prompt(logits[first : first + n], req.prompt)
    return logits[last]


def forward_prefill(
    runner: ModelRunner, batch: Sequence[tuple[Req, int]],
    wait_layer: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """The prefill forward of `batch` (each request's next `k` prompt tokens): each request's
    last-token logits, and the prompt logprobs pending on any of them recorded on the way."""
    seqs = [(r.tokens[r.kv_len : r.kv_len + k], r.kv_len, r.pages) for r, k in batch]
    plan = prefill_rows([(r.logprobs, r.kv_len, k) for r, k in batch])
    if plan is None:
        return runner.forward(seqs, wait_layer=wait_layer)
    return forward_prompt_logprobs(runner, seqs, batch, plan, wait_layer)


def sample_reqs(sampler: Sampler, logits: torch.Tensor, reqs: Sequence[Req]) -> list[int]:
    """One token per request (`Sampler.sample`: penalties, logit bias, grammar, per-request
    generators); records output logprobs on the requests that asked for them."""
    lps = [r.logprobs for r in reqs]
    res = sampler.sample(
        logits, [r.params for r in reqs], [r.output for r in reqs],
        prompt_ids=[r.prompt for r in reqs], generators=[r.generator for r in reqs],
        logprobs=[lp.top_k if lp is not None else None for lp in lps],
        grammars=[r.matcher for r in reqs],
    )
    if res.logprobs is not None and res.top_logprobs is not None:
        for i, lp in enumerate(lps):
            if lp is not None:
                lp.record_output(res.logprobs[i], res.top_logprobs[i])
    return res.tokens
