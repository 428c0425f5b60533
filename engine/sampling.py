"""Sampling parameters and the sampler.

`SamplingParams`: greedy, temperature, top-k, top-p, min-p, per-request seed, penalties
(`engine/penalties.py`), `logit_bias`, `min_tokens`, stop strings / token ids and structured
output (`json_schema`, `regex`, `ebnf`: `engine/grammar.py`).

`Sampler.sample(logits, params, output_ids, ...)` samples one token per row of a batch's logits
with every step batched on the device: logit processors over the [B, vocab] tensor, then for the
sampled rows temperature, top-k, top-p and min-p as row-wise tensor operations, and one draw per
row from the request's own `torch.Generator` (inverse CDF: one uniform u per row, the first token
whose cumulative probability reaches (1 - u) of the row's mass, found by one batched
`searchsorted`; FlashInfer's sampling kernels draw one uniform a row the same way). A row that is
greedy and uses no processor is `argmax(logits)`, exactly as `sample` (the engine's sampler
until the scheduler moves to `Sampler`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from engine.logprobs import token_logprobs
from engine.penalties import apply_penalties
from hicache_client.errors import ConfigError

if TYPE_CHECKING:
    from engine.grammar import Matcher

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
    # Keep what ended the request in the text: the stop string (and the rest of its token's
    # text), or the stop token's text; by default both are cut (SGLang's and vLLM's default).
    no_stop_trim: bool = False
    min_p: float = 0.0  # 0 = off; drop tokens below min_p * the top token's probability
    frequency_penalty: float = 0.0  # [-2, 2], OpenAI's
    presence_penalty: float = 0.0  # [-2, 2], OpenAI's
    repetition_penalty: float = 1.0  # (0, 2], 1 = off; HF / vLLM's, over prompt + output
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> [-100, 100]
    min_tokens: int = 0  # stop tokens suppressed until this many tokens are generated
    # vLLM's: only these token ids are sampled (None: all).
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words as token sequences: the last token of each is banned where the output
    # ends with the ones before it (a one-token word: always).
    bad_words_ids: list[list[int]] = field(default_factory=list)
    # Structured output, at most one (engine/grammar.py); json_schema '{"type": "object"}' is
    # OpenAI's response_format json_object.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

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
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2 <= v <= 2):
                raise ConfigError(f"{name} must be in [-2, 2], got {v}")
        rp = self.repetition_penalty
        if not (math.isfinite(rp) and 0 < rp <= 2):
            raise ConfigError(f"repetition_penalty must be in (0, 2], got {rp}")
        if self.min_tokens < 0 or self.min_tokens > self.max_new_tokens:
            raise ConfigError(
                f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_tokens}"
            )
        bias: dict[int, float] = {}
        for k, v in dict(self.logit_bias or {}).items():
            try:
                tok = int(k)  # OpenAI sends the ids as JSON object keys (strings)
            except (TypeError, ValueError):
                raise ConfigError(f"logit_bias keys must be token ids, got {k!r}") from None
            if tok < 0 or isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"logit_bias: bad entry {k!r}: {v!r}")
            if not (math.isfinite(v) and -100 <= v <= 100):
                raise ConfigError(f"logit_bias values must be in [-100, 100], got {v} for {k}")
            bias[tok] = float(v)
        self.logit_bias = bias
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
            if not self.allowed_token_ids:
                raise ConfigError("allowed_token_ids must not be empty")
        self.bad_words_ids = [[int(t) for t in w] for w in (self.bad_words_ids or [])]
        if any(not w for w in self.bad_words_ids):
            raise ConfigError("bad_words_ids: an empty word")
        given = [n for n in ("json_schema", "regex", "ebnf") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ConfigError(f"at most one of json_schema, regex, ebnf; got {', '.join(given)}")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the request names must exist in the model's vocabulary (called at
        admission, so the sampler never sees an id out of range)."""
        for name, ids in (("logit_bias", list(self.logit_bias)),
                          ("stop_token_ids", self.stop_token_ids),
                          ("allowed_token_ids", self.allowed_token_ids or []),
                          ("bad_words_ids", [t for w in self.bad_words_ids for t in w])):
            bad = sorted(t for t in ids if not 0 <= t < vocab_size)
            if bad:
                raise ConfigError(f"{name}: token ids {bad[:5]} outside the vocabulary "
                                  f"(size {vocab_size})")

    @property
    def uses_processors(self) -> bool:
        """Whether any logit processor (penalties, bias, min_tokens, allowed / banned tokens)
        applies to this request."""
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.allowed_token_ids is not None
            or self.bad_words_ids
        )

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, spec) of the structured-output constraint, or None."""
        for kind in ("json_schema", "regex", "ebnf"):
            spec = getattr(self, kind)
            if spec is not None:
                return kind, spec
        return None

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


@dataclass
class SampleResult:
    """One step's tokens; `logprobs[i]` / `top_logprobs[i]` for rows that asked (None for the
    others; both lists None when no row asked)."""

    tokens: list[int]
    logprobs: list[float | None] | None = None
    top_logprobs: list[list[tuple[int, float]] | None] | None = None


class Sampler:
    """The batched sampler (module docstring). `eos_token_ids`: the model's stop tokens, which
    `min_tokens` suppresses (the set is read at each call, so the scheduler may share its own)."""

    def __init__(self, eos_token_ids: set[int] | None = None) -> None:
        self.eos_token_ids: set[int] = eos_token_ids if eos_token_ids is not None else set()

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]] | None = None,
        *,
        prompt_ids: Sequence[Sequence[int]] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        logprobs: Sequence[int | None] | None = None,
        grammars: Sequence[Matcher | None] | None = None,
    ) -> SampleResult:
        """One token per row of `logits` ([B, vocab]).

        `output_ids[i]`: the tokens request i generated so far (penalties, `min_tokens`);
        `prompt_ids[i]`: its prompt (only rows with a `repetition_penalty` read it);
        `generators[i]`: its `torch.Generator` (None: torch's default one); `logprobs[i]`: None =
        no logprobs, 0 = the chosen token's, k = also the top k; `grammars[i]`: an
        `engine.grammar.Matcher` (or None) that constrains the row and accepts the chosen token.
        """
        b, vocab = logits.shape
        for name, seq in (("params", params), ("output_ids", output_ids),
                          ("prompt_ids", prompt_ids), ("generators", generators),
                          ("logprobs", logprobs), ("grammars", grammars)):
            if seq is not None and len(seq) != b:
                raise ValueError(f"{len(seq)} {name} for {b} rows")
        outs: Sequence[Sequence[int]] = output_ids if output_ids is not None else [[]] * b
        matchers = {i: g for i, g in enumerate(grammars or []) if g is not None}
        constrained = sorted(matchers)
        x = logits
        if constrained or any(p.uses_processors for p in params):
            x = logits.float().clone()  # the caller's logits stay raw (logprobs read them)
            apply_penalties(x, params, outs, prompt_ids, self.eos_token_ids)
            apply_token_masks(x, params, outs)
            if constrained:
                from engine.grammar import apply_grammars

                apply_grammars(x, constrained, [matchers[i] for i in constrained])
        tokens = [int(t) for t in x.argmax(dim=-1).tolist()]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            for i, t in zip(sampled, _sample_rows(x, sampled, params, generators)):
                tokens[i] = t
        for i in constrained:
            matchers[i].accept(tokens[i])
        res = SampleResult(tokens)
        asked = [i for i in range(b) if logprobs is not None and logprobs[i] is not None]
        if asked:
            lp = token_logprobs(
                logits[torch.tensor(asked, device=logits.device)],
                [tokens[i] for i in asked],
                [int(logprobs[i]) for i in asked],  # type: ignore[index, arg-type]
            )
            res.logprobs = [None] * b
            res.top_logprobs = [None] * b
            for j, i in enumerate(asked):
                res.logprobs[i] = lp.chosen[j]
                res.top_logprobs[i] = lp.top[j]
        return res


def apply_token_masks(x: torch.Tensor, params: Sequence[SamplingParams],
                      output_ids: Sequence[Sequence[int]]) -> None:
    """vLLM's `allowed_token_ids` and `bad_words`, in place on the [B, vocab] logits: every
    token outside a row's allowed ids, and the last token of each bad word whose earlier
    tokens end the row's output, to -inf."""
    for i, p in enumerate(params):
        if p.allowed_token_ids is not None:
            keep = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=x.device)
            row = torch.full_like(x[i], float("-inf"))
            row[keep] = x[i, keep]
            x[i] = row
        if p.bad_words_ids:
            out = list(output_ids[i])
            banned = [w[-1] for w in p.bad_words_ids
                      if len(w) == 1 or len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:]
                      == w[:-1]]
            if banned:
                x[i, torch.tensor(banned, dtype=torch.long, device=x.device)] = float("-inf")


def _sample_rows(
    x: torch.Tensor,
    rows: list[int],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None,
) -> list[int]:
    """Tokens for the non-greedy rows of the (processed) logits `x`: temperature, top-k, top-p,
    min-p as [R, vocab] tensor operations, then one uniform draw per row."""
    dev = x.device
    vocab = x.shape[1]
    ps = [params[i] for i in rows]
    idx = torch.tensor(rows, device=dev)
    temp = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev)[:, None]
    z = x[idx].float() / temp
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in ps]
    if any(ks):
        kmax = max(ks)
        vals = torch.topk(z, kmax, dim=-1).values
        kth = vals.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=dev)[:, None])
        has_k = torch.tensor([k > 0 for k in ks], device=dev)[:, None]
        kth = torch.where(has_k, kth, torch.full_like(kth, float("-inf")))
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    tp = [j for j, p in enumerate(ps) if p.top_p < 1.0]
    if tp:
        # Keep the smallest set whose mass reaches top_p, and always the most likely token.
        tpi = torch.tensor(tp, device=dev)
        sub = probs[tpi]
        sp, order = torch.sort(sub, dim=-1, descending=True, stable=True)
        top_p = torch.tensor([ps[j].top_p for j in tp], dtype=sp.dtype, device=dev)[:, None]
        drop = (sp.cumsum(-1) - sp) >= top_p
        drop[:, 0] = False
        probs[tpi] = torch.zeros_like(sub).scatter_(1, order, sp.masked_fill(drop, 0.0))
    mp = [j for j, p in enumerate(ps) if p.min_p > 0]
    if mp:
        mpi = torch.tensor(mp, device=dev)
        sub = probs[mpi]
        min_p = torch.tensor([ps[j].min_p for j in mp], dtype=sub.dtype, device=dev)[:, None]
        thr = sub.max(dim=-1, keepdim=True).values * min_p
        probs[mpi] = sub.masked_fill(sub < thr, 0.0)
    # Inverse CDF over the (unnormalised) kept mass: v = (1 - u) * mass lies in (0, mass], and
    # the first token whose cumulative sum reaches v has a probability > 0 (a dropped token adds
    # exactly 0, so its cumulative sum equals its predecessor's, which is below v). Each row
    # draws u from its own generator: a request's tokens depend on its seed, never on the batch.
    u = torch.empty((len(rows), 1), dtype=probs.dtype, device=dev)
    for j, i in enumerate(rows):
        gen = generators[i] if generators is not None else None
        gdev = gen.device if gen is not None else dev
        u[j] = torch.rand(1, generator=gen, device=gdev, dtype=probs.dtype).to(dev)
    cdf = probs.cumsum(dim=-1)
    v = (1.0 - u) * cdf[:, -1:]
    toks = torch.searchsorted(cdf, v).squeeze(1).clamp_(max=vocab - 1)
    # A degenerate distribution (NaN, or nothing left) falls back to greedy: never fail a batch.
    ok = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
    toks = torch.where(ok, toks, x[idx].argmax(dim=-1))
    return [int(t) for t in toks.tolist()]
