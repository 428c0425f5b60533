"""`engine.detokenizer.TextStream` against the quadratic decode it replaced: for random token
sequences of the demo tokenizer (multi-byte UTF-8 split across tokens, special tokens, both
`skip_special_tokens` values) and stop strings cut from the decoded text at random places (so
they straddle tokens), the text, the stop string and the step it ends at are exactly the old
`decode(output[:k])` + `find` result, and the released increments concatenate to the final text
without ever showing text that a stop string later removes."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from engine.demo_model import ensure_demo_model
from engine.detokenizer import TextStream
from engine.tokenizer import Tokenizer

EOS = 4


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(ensure_demo_model())


def quadratic(tok: Tokenizer, ids: Sequence[int], stop: list[str], skip: bool,
              stop_ids: set[int]) -> tuple[str, str | int | None, int]:
    """The scheduler's former `_append_token`: decode the whole output after every token."""
    text = ""
    for k in range(1, len(ids) + 1):
        reason: str | int | None = ids[k - 1] if ids[k - 1] in stop_ids else None
        text = tok.decode(ids[:k], skip_special_tokens=skip)
        if reason is None:
            for s in stop:
                idx = text.find(s)
                if idx >= 0:
                    return text[:idx], s, k
        if reason is not None:
            return text, reason, k
    return text, None, len(ids)


def incremental(tok: Tokenizer, ids: Sequence[int], stop: list[str], skip: bool,
                stop_ids: set[int]) -> tuple[str, str | int | None, int, list[str]]:
    """The same loop through `TextStream`, as the scheduler runs it now."""
    stream = TextStream(tok.decode, skip_special_tokens=skip, stop=stop)
    out: list[int] = []
    pieces: list[str] = []
    for t in ids:
        out.append(t)
        reason: str | int | None = t if t in stop_ids else None
        matched = stream.push(out, check_stop=reason is None)
        if matched is not None:
            reason = matched
        if reason is not None or len(out) == len(ids):
            stream.finish()
        pieces.append(stream.take())
        if reason is not None:
            return stream.text, reason, len(out), pieces
    return stream.text, None, len(out), pieces


def random_ids(rnd: random.Random, n: int, vocab: int) -> list[int]:
    # Mostly plain tokens, some special ids (0-4), runs of high bytes (split characters).
    out = []
    for _ in range(n):
        r = rnd.random()
        out.append(rnd.randrange(0, 5) if r < 0.03 else rnd.randrange(5, vocab))
    return out


def test_equals_the_quadratic_decode(tok: Tokenizer) -> None:
    rnd = random.Random(1234)
    vocab = tok.vocab_size
    # Text with multi-byte characters, so stop strings and ids cut through UTF-8 sequences.
    samples = ["héllo wörld 😀 naïve café — “quotes” ½ 日本語 ok", "a\u00e9\u00e9b 😀😀 c"]
    checked = stopped = straddling = 0
    for case in range(400):
        if case % 4 == 0:
            ids = tok.encode(rnd.choice(samples) * rnd.randint(1, 3))
        else:
            ids = random_ids(rnd, rnd.randint(1, 48), vocab)
        skip = rnd.random() < 0.7
        full = tok.decode(ids, skip_special_tokens=skip)
        stop: list[str] = []
        for _ in range(rnd.randint(0, 3)):
            if full and rnd.random() < 0.8:
                a = rnd.randrange(len(full))
                stop.append(full[a : a + rnd.randint(1, 6)])
            else:
                stop.append(rnd.choice(["é", "😀", "zz", "\ufffd", " w", "ö"]))
        stop_ids = {EOS} if rnd.random() < 0.5 else set()
        want = quadratic(tok, ids, stop, skip, stop_ids)
        text, reason, steps, pieces = incremental(tok, ids, stop, skip, stop_ids)
        assert (text, reason, steps) == want, (ids, stop, skip)
        assert "".join(pieces) == text
        checked += 1
        stopped += isinstance(reason, str)
        if isinstance(reason, str):
            # The match began in the text of earlier tokens and ended in the last one.
            straddling += len(text) < len(tok.decode(ids[: steps - 1], skip_special_tokens=skip))
    assert checked == 400 and stopped > 100 and straddling > 20, (stopped, straddling)


def test_held_back_text_is_never_shown_then_removed(tok: Tokenizer) -> None:
    ids = tok.encode("one two three four")
    stream = TextStream(tok.decode, stop=["three four", "thre!"])
    shown = ""
    out: list[int] = []
    for t in ids:
        out.append(t)
        matched = stream.push(out)
        shown += stream.take()
        if matched is not None:
            break
    assert matched == "three four"
    assert stream.text == "one two " and shown == "one two "


def test_a_split_character_is_released_whole(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1  # byte-level BPE: the emoji's four bytes span several tokens
    stream = TextStream(tok.decode)
    seen = []
    for k in range(1, len(ids) + 1):
        stream.push(ids[:k])
        seen.append(stream.take())
    assert seen[:-1] == [""] * (len(ids) - 1) and seen[-1] == "😀"
    stream.finish()
    assert stream.text == "😀"


def test_finish_releases_an_unfinished_character_as_a_full_decode_shows_it(
        tok: Tokenizer) -> None:
    ids = tok.encode("😀")[:-1]
    stream = TextStream(tok.decode)
    for k in range(1, len(ids) + 1):
        stream.push(ids[:k])
    assert stream.take() == ""
    stream.finish()
    assert stream.text == tok.decode(ids) and stream.text.endswith("\ufffd")


def test_engine_outputs_equal_the_quadratic_decode_on_the_demo_model(tok: Tokenizer) -> None:
    """End to end through the scheduler: seeded sampling makes each prompt's tokens the same
    with and without stop strings, so the stopped run must equal the quadratic reference over
    the free run's tokens (text, finish reason, length), and `text_delta`s add up to `text`."""
    from engine.engine import Engine

    rnd = random.Random(99)
    prompts = [f"Once upon a time {i}, héllo wörld 😀" * (1 + i % 3) for i in range(24)]
    free = {"max_new_tokens": 40, "ignore_eos": True, "temperature": 1.0}
    with Engine(max_total_tokens=8192, page_size=16) as engine:
        runs = [{**free, "seed": i, "skip_special_tokens": i % 5 != 0}
                for i in range(len(prompts))]
        base = engine.generate(prompts, runs)
        stops: list[list[str]] = []
        for out, sp in zip(base, runs):
            full = tok.decode(out["output_ids"], skip_special_tokens=sp["skip_special_tokens"])
            a = rnd.randrange(max(1, len(full)))
            stops.append([full[a : a + rnd.randint(2, 5)], "\u00e9"] if full else ["x"])
        stopped_runs = [{**sp, "stop": st} for sp, st in zip(runs, stops)]
        rids = [engine.add_request(p, sp) for p, sp in zip(prompts, stopped_runs)]
        deltas = {r: "" for r in rids}
        final: dict[str, dict] = {}
        while len(final) < len(rids):
            for u in engine.step():
                deltas[u["rid"]] += u["text_delta"]
                if u["finished"]:
                    final[u["rid"]] = u
    n_stopped = 0
    for rid, out, sp in zip(rids, base, stopped_runs):
        got = final[rid]
        text, reason, steps = quadratic(tok, out["output_ids"], sp["stop"],
                                        sp["skip_special_tokens"], set())
        assert got["output_ids"] == out["output_ids"][:steps]
        assert got["text"] == text and deltas[rid] == text
        fr = got["meta_info"]["finish_reason"]
        if reason is None:
            assert fr == {"type": "length", "length": 40}
        else:
            assert fr == {"type": "stop", "matched": reason}
            n_stopped += 1
    assert n_stopped >= 12
