"""`--sample`'s streamed sampler (`tools/hitrate/sample.py`): at rate 1 the exact curve; below,
within a stated tolerance of the exact curve on traces with shared prefixes, holding about RATE
of the pages, and its validation slice is the exact curve of the trace's first requests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.tools.conftest import prefix_trace
from tests.tools.test_fast import chained_trace, streamed
from tests.tools.test_mrc import BS
from tools.hitrate import fast, mrc
from tools.hitrate.sample import Sample, SampleSink
from tools.hitrate.traces import read_trace


def sampled(path: Path, rate: float, block: int, page: int, check: int = 1 << 40,
            limit: int | None = None, warmup: float = 0.0) -> Sample:
    sink = SampleSink(rate, block, page, check_requests=check, warmup=warmup)
    read_trace(path, block_size=block, sink=sink, limit=limit)
    return sink.finish()


def max_error(smp: Sample, exact: fast.ArrayStack, points: int = 15) -> float:
    caps = mrc.mrc_points(exact, points)
    return max(abs(smp.curve.hit_tokens(c) - exact.hit_tokens(c)) for c in caps) / (
        exact.input_tokens)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("warmup", [0.0, 0.3])
def test_rate_one_is_the_exact_curve(tmp_path: Path, seed: int, page_size: int,
                                     warmup: float) -> None:
    """Every page kept at weight 1: the sampled distances are the exact ones, at every
    capacity, with partial blocks and outputs inserted."""
    path = chained_trace(tmp_path, seed)
    _, arrs = streamed(path, page_size, block_size=BS)
    exact = fast.stack_distances(arrs, warmup=warmup)
    smp = sampled(path, 1.0, BS, page_size, warmup=warmup)
    assert smp.sampled_refs == smp.page_refs == len(arrs.pages)
    assert smp.requests == exact.requests and smp.curve.input_tokens == exact.input_tokens
    for c in range(0, exact.max_pages + 2):
        assert smp.curve.hit_tokens(c) == exact.hit_tokens(c), c
    assert smp.check_exact is not None and smp.check_sampled is not None
    assert smp.check_requests == arrs.requests


def test_within_tolerance_on_a_shared_prefix_trace(tmp_path: Path) -> None:
    """A random shared-prefix trace (fixed seed: 2,000 requests over 40 prefix chains, a one-off
    request after each), the slice the whole trace: sampled at 0.1 the 15-point curve is within
    0.01 of the exact one (measured 0.0071); the pages not kept whole are sampled at about 0.1."""
    path = prefix_trace(tmp_path / "p.jsonl", seed=8, requests=2000, roots=40, max_blocks=30,
                        one_offs=True)
    _, arrs = streamed(path, 16, block_size=16)
    exact = fast.stack_distances(arrs)
    smp = sampled(path, 0.1, 16, 16)
    err = max_error(smp, exact)
    assert err == pytest.approx(0.0071074, abs=1e-6) and err < 0.01
    rest = smp.page_refs - smp.hot_refs
    assert 0.08 * rest < smp.sampled_refs - smp.hot_refs < 0.12 * rest
    assert smp.hot_blocks > 0 and smp.check_requests == arrs.requests


def test_reference_trace(mooncake_trace: Path) -> None:
    """The Mooncake conversation trace (shared system prompt, multi-turn histories) at 0.1 and
    0.01: exact numbers (the hash is fixed); at 0.1 within 0.005 of the exact curve, holding
    about 0.1 of the references of the pages not kept whole."""
    _, arrs = streamed(mooncake_trace, 512)
    exact = fast.stack_distances(arrs)
    s1 = sampled(mooncake_trace, 0.1, 512, 512)
    assert (s1.sampled_refs, s1.page_refs, s1.hot_blocks) == (57_071, 291_010, 1_341)
    assert max_error(s1, exact) == pytest.approx(0.0045917, abs=1e-6)
    rest = s1.page_refs - s1.hot_refs
    assert 0.09 * rest < s1.sampled_refs - s1.hot_refs < 0.11 * rest
    s2 = sampled(mooncake_trace, 0.01, 512, 512)
    assert max_error(s2, exact) < 0.04  # 14,635 references: too few for 0.01 (docs/hitrate.md)


def test_the_slice_is_the_exact_curve_of_the_first_requests(tmp_path: Path) -> None:
    """The validation slice is the first K requests read whole: its exact curve is that of the
    trace cut at K, and its sampled curve that of the same kept pages (the sample's prefix)."""
    path = prefix_trace(tmp_path / "p.jsonl", seed=3, requests=600, roots=10, max_blocks=12)
    k = 250
    smp = sampled(path, 0.2, 16, 16, check=k)
    _, head = streamed(path, 16, block_size=16, limit=k)
    want = fast.stack_distances(head)
    assert smp.check_requests == k and smp.check_exact is not None
    assert smp.check_exact.input_tokens == want.input_tokens
    for c in (1, 5, 20, 100, want.max_pages):
        assert smp.check_exact.hit_tokens(c) == want.hit_tokens(c)
    # the slice's sampled curve: the sample of the trace read only up to K (same hot blocks)
    cut = sampled(path, 0.2, 16, 16, check=k, limit=k)
    assert smp.check_sampled is not None
    assert np.array_equal(smp.check_sampled.dist, cut.curve.dist)
    assert np.array_equal(smp.check_sampled.cum, cut.curve.cum)
    assert smp.check_sampled.input_tokens == want.input_tokens


def test_chunked_sampling_equals_one_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """References are sampled in chunks as they stream in: the chunk size changes nothing."""
    import tools.hitrate.sample as sample

    path = prefix_trace(tmp_path / "p.jsonl", seed=5, requests=800, roots=12, max_blocks=20,
                        one_offs=True)
    whole = sampled(path, 0.25, 16, 4, check=100)
    monkeypatch.setattr(sample, "_CHUNK", 7)
    small = sampled(path, 0.25, 16, 4, check=100)
    assert np.array_equal(whole.curve.dist, small.curve.dist)
    assert np.array_equal(whole.curve.cum, small.curve.cum)
    assert whole.sampled_refs == small.sampled_refs


def test_ids_past_int64(tmp_path: Path) -> None:
    """Hash ids of 64 bits and more (stand-ins below 0, as the exact reader's) sample like any:
    at rate 1 the exact curve."""
    import json

    big = [2**70 + 5, 2**63, 2**63 - 1, 7]
    rows = [{"timestamp": i, "input_length": 8, "output_length": 5, "hash_ids": h}
            for i, h in enumerate([[big[0], big[1]], [big[0], big[1]], [big[2], big[3]],
                                   [big[0], big[1]], [big[2], big[3]]])]
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, arrs = streamed(path, 4, block_size=4)
    exact = fast.stack_distances(arrs)
    for check in (2, 1 << 40):
        smp = sampled(path, 1.0, 4, 4, check=check)
        for c in range(0, exact.max_pages + 2):
            assert smp.curve.hit_tokens(c) == exact.hit_tokens(c), (check, c)
