"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from hicache.errors import ConfigError

# Temperatures below this sample as greedy (SGLang does the same): dividing logits by a smaller
# number overflows float32 and the softmax turns into NaN.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = no limit
    seed: int | None = None  # per-request seed (None: drawn from the engine's generator)
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"top_k must be -1 or >= 1, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @classmethod
    def from_any(cls, value: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
        if value is None:
            return cls()
        if isinstance(value, SamplingParams):
            return value
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"unknown sampling parameters: {', '.join(unknown)}")
        return cls(**dict(value))


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One next token per row of `logits` ([B, vocab], float32)."""
    out: list[int] = []
    greedy = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            out.append(int(greedy[i]))
            continue
        row = logits[i].float() / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sp, idx = torch.sort(probs, descending=True)
            # Keep the smallest set whose mass reaches top_p, and always the most likely token
            # (a top_p below float32's resolution would otherwise drop every token).
            drop = (sp.cumsum(-1) - sp) >= p.top_p
            drop[0] = False
            sp = sp.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sp)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
            out.append(int(greedy[i]))  # degenerate distribution: never fail the whole batch
            continue
        gen = generators[i]
        tok = torch.multinomial(probs.cpu(), 1, generator=gen) if gen is not None else (
            torch.multinomial(probs.cpu(), 1)
        )
        out.append(int(tok.item()))
    return out
