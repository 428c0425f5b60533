"""Logprobs of one request, and the prefill rows its prompt logprobs need.

A request that asks for logprobs carries a `ReqLogprobs`: `top_k` alternatives per token (0: the
chosen token's logprob only) and `start_len`, the first prompt token whose logprob is returned
(-1: output tokens only), as SGLang's `return_logprob` / `top_logprobs_num` / `logprob_start_len`.

Prompt token j (j >= 1) has the logprob that the logits at position j - 1 give it; token 0 has
none (None, as SGLang and OpenAI's `echo` report it). Those logits exist only where the prefill
computes the position, so a request with prompt logprobs pending limits its prefix match to
`cache_limit()` tokens (SGLang limits the match to `logprob_start_len` the same way): a cached
prefix is recomputed from the first position whose logits are needed, never stored. The chunks of
a long prompt compute their positions in order, so `next_pos` advances chunk by chunk (and a
retracted request resumes exactly where it stopped). Values are float32 `log_softmax` of the raw
logits (`engine.logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.logprobs import token_logprobs

# Most alternatives per token a request may ask for (OpenAI's chat allows 20).
MAX_TOP_LOGPROBS = 20

TopList = list[tuple[int, float]]


@dataclass
class ReqLogprobs:
    top_k: int  # alternatives per token (0: the chosen token's logprob only)
    start_len: int  # first prompt token with a logprob (-1: output tokens only)
    prompt_len: int
    next_pos: int = 0  # next prompt position whose logits are still needed
    prompt: list[float | None] = field(default_factory=list)  # tokens start_len.. of the prompt
    prompt_top: list[TopList | None] = field(default_factory=list)
    output: list[float] = field(default_factory=list)  # one per output token
    output_top: list[TopList] = field(default_factory=list)
    sent_output: int = 0  # output entries already reported
    sent_prompt: bool = False

    @classmethod
    def make(cls, top_k: int, start_len: int, prompt_len: int) -> ReqLogprobs:
        if not 0 <= top_k <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs_num must be in 0..{MAX_TOP_LOGPROBS}, got {top_k}")
        if not -1 <= start_len < prompt_len:
            raise ValueError(f"logprob_start_len must be -1 or in 0..{prompt_len - 1} (the "
                             f"prompt has {prompt_len} tokens), got {start_len}")
        lp = cls(top_k=top_k, start_len=start_len, prompt_len=prompt_len)
        if start_len < 0:
            lp.next_pos = prompt_len  # nothing pending
        else:
            lp.next_pos = max(start_len, 1) - 1
            if start_len == 0:
                lp.prompt.append(None)
                lp.prompt_top.append(None)
        return lp

    @property
    def prompt_pending(self) -> bool:
        return self.next_pos < self.prompt_len - 1

    def cache_limit(self, n: int) -> int:
        """How many leading tokens of the `n` the cache may serve."""
        return min(n, self.next_pos) if self.prompt_pending else n

    def record_prompt(self, logits: torch.Tensor, prompt: Sequence[int]) -> None:
        """`logits`: rows for positions next_pos, next_pos + 1, ... of the prompt."""
        r = int(logits.shape[0])
        if r == 0:
            return
        p = self.next_pos
        lp = token_logprobs(logits, list(prompt[p + 1 : p + 1 + r]), self.top_k)
        self.prompt.extend(lp.chosen)
        self.prompt_top.extend(lp.top)
        self.next_pos += r

    def record_output(self, logprob: float | None, top: TopList | None) -> None:
        self.output.append(float(logprob) if logprob is not None else float("nan"))
        self.output_top.append(list(top or []))

    def take(self) -> dict[str, Any]:
        """What is new since the last call, as plain lists (msgpack-able): `output` [[logprob,
        id]...] with `output_top` [[[id, logprob]...]...] for the output tokens (`ids` given by
        the caller), and, once, `prompt` / `prompt_top` with `prompt_start`."""
        out: dict[str, Any] = {"output": self.output[self.sent_output :],
                               "output_top": [[list(t) for t in x]
                                              for x in self.output_top[self.sent_output :]]}
        self.sent_output = len(self.output)
        if not self.sent_prompt and not self.prompt_pending and self.start_len >= 0:
            self.sent_prompt = True
            out["prompt_start"] = self.start_len
            out["prompt"] = list(self.prompt)
            out["prompt_top"] = [None if x is None else [list(t) for t in x]
                                 for x in self.prompt_top]
        return out


def prefill_rows(chunks: Sequence[tuple[ReqLogprobs | None, int, int]]) -> \
        tuple[list[int], list[int], list[tuple[int, int]]] | None:
    """Rows of a prefill's flat token outputs to compute logits for, when some request of the
    batch needs prompt logprobs (None otherwise: the last row of each request, as always).

    `chunks`: per request (its logprobs, first new position, new tokens). Returns (rows, the
    index into rows of each request's last token, per request (first index into rows of its
    prompt rows, how many))."""
    if not any(lp is not None and lp.prompt_pending for lp, _, _ in chunks):
        return None
    rows: list[int] = []
    last: list[int] = []
    spans: list[tuple[int, int]] = []
    base = 0
    for lp, start, k in chunks:
        first = len(rows)
        n_prompt = 0
        if lp is not None and lp.prompt_pending:
            lo, hi = max(lp.next_pos, start), min(start + k, lp.prompt_len - 1)
            if lo != lp.next_pos:  # cannot happen: the cache match stops at next_pos
                raise RuntimeError(f"prompt logprobs: position {lp.next_pos} was not computed")
            n_prompt = max(0, hi - lo)
            rows.extend(base + p - start for p in range(lo, lo + n_prompt))
        spans.append((first, n_prompt))
        end = base + k - 1
        if rows and rows[-1] == end:
            last.append(len(rows) - 1)
        else:
            rows.append(end)
            last.append(len(rows) - 1)
        base += k
    return rows, last, spans
