"""Logit processors applied to a whole batch at once: `min_tokens`, `logit_bias`, repetition,
frequency and presence penalties (as vLLM and SGLang apply them: per-batch parameter tensors built
once per step, token counts by `scatter_add`, no Python loop over tokens or vocabulary).

Semantics (the order is the order of application, as in vLLM):

1. `min_tokens`: while a request has generated fewer than `min_tokens` tokens, its stop tokens
   (the model's EOS ids unless `ignore_eos`, and `stop_token_ids`) get logit -inf.
2. `logit_bias`: `{token_id: bias}` added to the logits (OpenAI's semantics).
3. `repetition_penalty` r (1 = off; HF / vLLM): every token that occurs in the prompt or the
   output so far has its logit divided by r when positive, multiplied by r when not.
4. `frequency_penalty` f and `presence_penalty` p (0 = off; OpenAI): with c the count of a token
   in the output so far, `logit -= f * c + p * (c > 0)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch


class PenaltyParams(Protocol):
    """The fields of `engine.sampling.SamplingParams` read here (no import: no cycle)."""

    min_tokens: int
    ignore_eos: bool
    stop_token_ids: list[int]
    logit_bias: dict[int, float]
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float


def _padded(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[R, max len] int64 (at least one column), short rows padded with `pad`."""
    width = max(1, max((len(r) for r in rows), default=0))
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out.to(device)


def token_counts(ids: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[R, vocab] float32 counts of each token id per row, by one `scatter_add`. Ids outside
    [0, vocab) are not counted."""
    clean = [[t for t in r if 0 <= t < vocab] for r in ids]
    idx = _padded(clean, vocab, device)  # the pad lands in an extra column, dropped below
    counts = torch.zeros((len(ids), vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[PenaltyParams],
    output_ids: Sequence[Sequence[int]],
    prompt_ids: Sequence[Sequence[int]] | None = None,
    eos_token_ids: Iterable[int] = (),
) -> None:
    """Applies the processors above to `logits` ([B, vocab] float32) in place; row i belongs to
    `params[i]` with `output_ids[i]` generated so far (and `prompt_ids[i]`, needed only for rows
    with a repetition penalty). Rows that use none of them are left untouched, bit for bit."""
    b, vocab = logits.shape
    dev = logits.device
    eos = [int(t) for t in eos_token_ids]

    # 1. min_tokens, 2. logit_bias: one index_put each over the flattened (row, token) pairs.
    ban_r: list[int] = []
    ban_t: list[int] = []
    bias_r: list[int] = []
    bias_t: list[int] = []
    bias_v: list[float] = []
    for i, p in enumerate(params):
        if p.min_tokens and len(output_ids[i]) < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
            toks = [t for t in sorted(stops) if 0 <= t < vocab]
            ban_r += [i] * len(toks)
            ban_t += toks
        if p.logit_bias:
            for t, v in p.logit_bias.items():
                if 0 <= t < vocab:
                    bias_r.append(i)
                    bias_t.append(t)
                    bias_v.append(float(v))
    if ban_r:
        idx = (torch.tensor(ban_r, device=dev), torch.tensor(ban_t, device=dev))
        logits.index_put_(idx, torch.tensor(float("-inf"), device=dev))
    if bias_r:
        idx = (torch.tensor(bias_r, device=dev), torch.tensor(bias_t, device=dev))
        logits.index_put_(idx, torch.tensor(bias_v, dtype=logits.dtype, device=dev), accumulate=True)

    # 3. repetition penalty over prompt + output.
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        if prompt_ids is None:
            raise ValueError("repetition_penalty needs the prompt ids")
        seen = token_counts([list(prompt_ids[i]) + list(output_ids[i]) for i in rep], vocab, dev)
        r = torch.tensor([params[i].repetition_penalty for i in rep], device=dev)[:, None]
        rows = torch.tensor(rep, device=dev)
        x = logits[rows]
        pen = torch.where(x > 0, x / r, x * r)
        logits[rows] = torch.where(seen > 0, pen, x)

    # 4. frequency and presence penalties over the output.
    fp = [i for i, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if fp:
        counts = token_counts([output_ids[i] for i in fp], vocab, dev)
        f = torch.tensor([params[i].frequency_penalty for i in fp], device=dev)[:, None]
        pr = torch.tensor([params[i].presence_penalty for i in fp], device=dev)[:, None]
        rows = torch.tensor(fp, device=dev)
        logits[rows] = logits[rows] - (f * counts + pr * (counts > 0).float())
