"""Log-probabilities of chosen tokens and the top-k alternatives, for a batch of logit rows in one
call (one `log_softmax`, one `gather`, one `topk`).

Used for output logprobs (the rows are a decode step's logits, the chosen tokens the sampled
ones) and for prompt logprobs (the rows are a prefill's logits at positions 0..n-2, the chosen
tokens the prompt's tokens 1..n-1). Values are float32 `log_softmax` of the logits given: the
sampler passes the model's raw logits (before penalties, temperature and truncation), as vLLM's
default `raw_logprobs` mode and OpenAI's API report them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Logprobs:
    """Per row: the chosen token's logprob, and the top `k_i` (token id, logprob) pairs, most
    likely first (ties broken by the lower id)."""

    chosen: list[float]
    top: list[list[tuple[int, float]]]


def token_logprobs(
    logits: torch.Tensor, chosen: Sequence[int] | torch.Tensor, top_k: int | Sequence[int] = 0
) -> Logprobs:
    """`logits` [R, vocab]; `chosen` R token ids; `top_k` one k for every row or one per row
    (0 = none). Returns Python lists (one device -> host copy)."""
    r, vocab = logits.shape
    ks = [int(top_k)] * r if isinstance(top_k, int) else [int(k) for k in top_k]
    if len(ks) != r:
        raise ValueError(f"{len(ks)} top_k values for {r} rows")
    if any(k < 0 for k in ks):
        raise ValueError(f"top_k must be >= 0, got {ks}")
    lp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.as_tensor(chosen, dtype=torch.long, device=logits.device).reshape(r, 1)
    chosen_lp = lp.gather(1, idx).squeeze(1).cpu().tolist()
    kmax = min(max(ks, default=0), vocab)
    top: list[list[tuple[int, float]]] = [[] for _ in range(r)]
    if kmax > 0:
        # Sort by (logprob desc, id asc): a stable descending sort keeps the lower id first.
        vals, ids = torch.sort(lp, dim=-1, descending=True, stable=True)
        top_v, top_i = vals[:, :kmax].cpu().tolist(), ids[:, :kmax].cpu().tolist()
        for i, k in enumerate(ks):
            top[i] = list(zip(top_i[i][:k], top_v[i][:k]))
    return Logprobs(chosen=chosen_lp, top=top)
