"""The batched sampler (`engine.sampling.Sampler`) against a slow reference that processes one
row and one token at a time: penalties, logit_bias, min_tokens, temperature, top-k, top-p, min-p,
per-request seeds and logprobs, exact (same float32 operations per element, same draws)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
import torch

from engine.logprobs import token_logprobs
from engine.penalties import apply_penalties, token_counts
from engine.sampling import Sampler, SamplingParams, sample
from hicache_client.errors import ConfigError

V = 64
EOS = {1, 2}
F32 = torch.float32


def ref_process(row: torch.Tensor, p: SamplingParams, out: Sequence[int],
                prompt: Sequence[int]) -> torch.Tensor:
    """One row, token by token, in the documented order."""
    x = row.clone().float()
    if p.min_tokens and len(out) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else EOS):
            x[t] = float("-inf")
    for t, b in p.logit_bias.items():
        x[t] = x[t] + torch.tensor(b, dtype=F32)
    if p.repetition_penalty != 1.0:
        r = torch.tensor(p.repetition_penalty, dtype=F32)
        for t in set(prompt) | set(out):
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
    if p.frequency_penalty or p.presence_penalty:
        f = torch.tensor(p.frequency_penalty, dtype=F32)
        pr = torch.tensor(p.presence_penalty, dtype=F32)
        for t in set(out):
            c = torch.tensor(float(out.count(t)), dtype=F32)
            x[t] = x[t] - (f * c + pr)
    return x


def ref_sample(x: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """One processed row: greedy, or temperature / top-k / top-p / min-p and one uniform draw
    from the row's generator, then a linear scan for the first cumulative sum reaching it."""
    if p.greedy:
        return int(x.argmax())
    z = x / torch.tensor(p.temperature, dtype=F32)
    if 0 < p.top_k < V:
        kth = torch.topk(z, p.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    if p.top_p < 1.0:
        sp, idx = torch.sort(probs, descending=True, stable=True)
        cs, top_p = sp.cumsum(-1), float(torch.tensor(p.top_p, dtype=F32))
        # The smallest prefix whose mass reaches top_p: token j stays while the mass before it
        # (cs[j] - sp[j], in float32) is below top_p; the first always stays.
        keep = [j == 0 or float(cs[j] - sp[j]) < top_p for j in range(V)]
        kept = torch.zeros_like(probs)
        for j in range(V):
            if keep[j]:
                kept[idx[j]] = sp[j]
        probs = kept
    if p.min_p > 0:
        thr = probs.max() * torch.tensor(p.min_p, dtype=F32)
        probs = torch.where(probs < thr, torch.zeros_like(probs), probs)
    u = torch.rand(1, generator=gen)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        return int(x.argmax())
    cdf = probs.cumsum(-1)
    v = float(((1.0 - u) * cdf[-1])[0])
    tok = next(t for t in range(V) if float(cdf[t]) >= v)
    assert probs[tok] > 0
    return tok


def random_params(rng: random.Random, max_new: int = 40) -> SamplingParams:
    kw: dict[str, object] = {"max_new_tokens": max_new}
    if rng.random() < 0.7:
        kw["temperature"] = rng.choice([0.5, 1.0, 1.7])
        if rng.random() < 0.4:
            kw["top_k"] = rng.choice([1, 3, 10, V + 5])
        if rng.random() < 0.4:
            kw["top_p"] = rng.choice([0.3, 0.8, 0.95])
        if rng.random() < 0.4:
            kw["min_p"] = rng.choice([0.05, 0.2])
    if rng.random() < 0.4:
        kw["frequency_penalty"] = rng.choice([-0.5, 0.4, 1.5])
    if rng.random() < 0.4:
        kw["presence_penalty"] = rng.choice([-1.0, 0.7])
    if rng.random() < 0.4:
        kw["repetition_penalty"] = rng.choice([0.8, 1.3, 2.0])
    if rng.random() < 0.3:
        kw["logit_bias"] = {str(rng.randrange(V)): rng.choice([-100, -3.5, 2.25, 100])}
    if rng.random() < 0.3:
        kw["min_tokens"] = rng.choice([2, 5])
        kw["stop_token_ids"] = [rng.randrange(3, V)]
        kw["ignore_eos"] = rng.random() < 0.3
    return SamplingParams(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(12))
def test_batched_equals_the_slow_reference(seed: int) -> None:
    rng = random.Random(seed)
    b = rng.randint(1, 7)
    params = [random_params(rng) for _ in range(b)]
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 12))] for _ in range(b)]
    outs: list[list[int]] = [[rng.randrange(V) for _ in range(rng.randint(0, 6))] for _ in range(b)]
    seeds = [rng.randrange(2**31) for _ in range(b)]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    ref_gens = [torch.Generator().manual_seed(s) for s in seeds]
    sampler = Sampler(set(EOS))
    logit_gen = torch.Generator().manual_seed(seed)
    for _step in range(6):
        logits = torch.randn(b, V, generator=logit_gen) * 3
        raw = logits.clone()
        want_x = [ref_process(logits[i], params[i], outs[i], prompts[i]) for i in range(b)]
        # The processors alone, batched, equal the reference bit for bit.
        x = logits.clone()
        apply_penalties(x, params, outs, prompts, EOS)
        for i in range(b):
            assert torch.equal(x[i], want_x[i]), (i, params[i])
        want = [ref_sample(want_x[i], params[i], ref_gens[i]) for i in range(b)]
        lp_k = [None if i % 2 else i for i in range(b)]
        res = sampler.sample(logits, params, outs, prompt_ids=prompts, generators=gens,
                             logprobs=lp_k)
        assert res.tokens == want
        assert torch.equal(logits, raw)  # the caller's logits are not modified
        full = torch.log_softmax(raw, dim=-1)
        for i in range(b):
            if lp_k[i] is None:
                assert res.logprobs is not None and res.logprobs[i] is None
                continue
            assert res.logprobs is not None and res.top_logprobs is not None
            assert res.logprobs[i] == float(full[i, want[i]])
            order = sorted(range(V), key=lambda t: (-float(full[i, t]), t))[: lp_k[i]]
            assert res.top_logprobs[i] == [(t, float(full[i, t])) for t in order]
        for i in range(b):
            outs[i].append(want[i])


def test_greedy_rows_without_processors_take_todays_path() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, V, generator=g)
    params = [SamplingParams(), SamplingParams(top_k=1, temperature=0.7), SamplingParams(),
              SamplingParams(temperature=1e-6), SamplingParams()]
    res = Sampler(set(EOS)).sample(logits, params)
    assert res.tokens == sample(logits, params, [None] * 5) == logits.argmax(-1).tolist()
    assert (res.logprobs, res.top_logprobs) == (None, None)


def test_a_seeded_request_samples_the_same_alone_or_in_any_batch() -> None:
    p = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=20, frequency_penalty=0.5)
    logit_gen = torch.Generator().manual_seed(0)
    steps = [torch.randn(4, V, generator=logit_gen) for _ in range(8)]
    sampler = Sampler()

    def run(rows: list[int], seeds: list[int]) -> list[list[int]]:
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        outs: list[list[int]] = [[] for _ in rows]
        for lg in steps:
            toks = sampler.sample(lg[rows], [p] * len(rows), outs, generators=gens).tokens
            for o, t in zip(outs, toks):
                o.append(t)
        return outs

    alone = run([0], [7])[0]
    assert run([0], [7])[0] == alone  # deterministic for the same seed
    assert run([0], [8])[0] != alone
    batch = run([3, 0, 1, 0], [5, 7, 9, 7])
    assert batch[1] == batch[3] == alone


def test_inverse_cdf_samples_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    toks = Sampler().sample(logits, [SamplingParams(temperature=1.0)] * 4000,
                            generators=gens).tokens
    freq = torch.bincount(torch.tensor(toks), minlength=4).float() / 4000
    # 4000 draws: the standard error of each frequency is below 0.008.
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_min_tokens_suppresses_stop_tokens_until_reached() -> None:
    logits = torch.zeros(1, V)
    logits[0, 1] = 10.0  # EOS is the greedy choice
    logits[0, 9] = 9.0  # then a stop token id
    p = SamplingParams(min_tokens=3, stop_token_ids=[9])
    s = Sampler(set(EOS))
    assert [s.sample(logits, [p], [[5] * n]).tokens[0] for n in range(5)] == [0, 0, 0, 1, 1]
    p = SamplingParams(min_tokens=3, ignore_eos=True)
    assert s.sample(logits, [p], [[]]).tokens == [1]  # EOS is no stop with ignore_eos


def test_logit_bias_and_penalties_steer_greedy() -> None:
    logits = torch.zeros(1, V)
    logits[0, 4] = 1.0
    s = Sampler()
    assert s.sample(logits, [SamplingParams(logit_bias={"7": 100})]).tokens == [7]
    assert s.sample(logits, [SamplingParams(logit_bias={4: -100})]).tokens == [0]
    assert s.sample(logits, [SamplingParams(presence_penalty=2.0)], [[4]]).tokens == [0]
    assert s.sample(logits, [SamplingParams(frequency_penalty=0.4)], [[4]]).tokens == [4]
    assert s.sample(logits, [SamplingParams(frequency_penalty=0.4)], [[4, 4, 4]]).tokens == [0]
    assert s.sample(logits, [SamplingParams(repetition_penalty=2.0)], [[]],
                    prompt_ids=[[4]]).tokens == [4]  # 1.0 / 2 is still the largest
    logits[0, 5] = 0.75
    assert s.sample(logits, [SamplingParams(repetition_penalty=2.0)], [[]],
                    prompt_ids=[[4]]).tokens == [5]


def test_token_counts_by_scatter_add() -> None:
    c = token_counts([[3, 3, 1], [], [V - 1, 70]], V, torch.device("cpu"))
    assert c.shape == (3, V)
    assert c[0, 3] == 2 and c[0, 1] == 1 and c[0].sum() == 3
    assert c[1].sum() == 0
    assert c[2, V - 1] == 1 and c[2].sum() == 1  # 70 is outside the vocabulary: not counted


def test_token_logprobs_one_call() -> None:
    logits = torch.tensor([[0.0, 1.0, 1.0, -2.0], [5.0, 0.0, 0.0, 0.0]])
    lp = token_logprobs(logits, [3, 0], [2, 0])
    full = torch.log_softmax(logits, dim=-1)
    assert lp.chosen == [float(full[0, 3]), float(full[1, 0])]
    assert lp.top == [[(1, float(full[0, 1])), (2, float(full[0, 2]))], []]
    assert math.isclose(sum(math.exp(v) for v in full[1].tolist()), 1.0, rel_tol=1e-6)
    with pytest.raises(ValueError):
        token_logprobs(logits, [0, 0], [1])


@pytest.mark.parametrize(("kw", "msg"), [
    ({"min_p": 1.5}, "min_p must be in [0, 1]"),
    ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2]"),
    ({"presence_penalty": float("nan")}, "presence_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, 2]"),
    ({"min_tokens": 200, "max_new_tokens": 10}, "min_tokens must be in [0, max_new_tokens=10]"),
    ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"3": 101}}, "logit_bias values must be in [-100, 100]"),
    ({"logit_bias": {"-3": 1}}, "logit_bias: bad entry"),
    ({"json_schema": "{}", "regex": "a"}, "at most one of json_schema, regex, ebnf"),
])
def test_bad_params_are_refused(kw: dict[str, object], msg: str) -> None:
    with pytest.raises(ConfigError, match=msg.replace("[", r"\[").replace("(", r"\(")):
        SamplingParams(**kw)  # type: ignore[arg-type]


def test_check_vocab() -> None:
    SamplingParams(logit_bias={"5": 1.0}, stop_token_ids=[3]).check_vocab(V)
    with pytest.raises(ConfigError, match=r"logit_bias: token ids \[64\] outside"):
        SamplingParams(logit_bias={"64": 1.0}).check_vocab(V)
    with pytest.raises(ConfigError, match=r"stop_token_ids: token ids \[99\] outside"):
        SamplingParams(stop_token_ids=[99]).check_vocab(V)
