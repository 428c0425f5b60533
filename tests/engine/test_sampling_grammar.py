"""Structured output (engine/grammar.py, xgrammar on CPU) on the demo model's tokenizer: whatever
the logits, a JSON-schema request's output parses and validates, a regex request's output matches,
an EBNF request's output is in the language; bad specs are a ConfigError naming the problem."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from engine.demo_model import ensure_demo_model
from engine.grammar import GrammarCompiler, Matcher
from engine.sampling import Sampler, SamplingParams
from hicache_client.errors import ConfigError

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string",
                                                                         "minLength": 1,
                                                                         "maxLength": 4},
                                               "maxItems": 3},
                                      "ok": {"type": "boolean"},
                                      "kind": {"enum": ["a", "b", "c"]}},
     "required": ["tags", "ok", "kind"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"},
                                      "inner": {"type": "object",
                                                "properties": {"x": {"type": "number"}},
                                                "required": ["x"]}},
     "required": ["code", "inner"]},
]


@pytest.fixture(scope="module")
def demo() -> Iterator[tuple[Any, int, list[int]]]:
    from transformers import AutoTokenizer

    d: Path = ensure_demo_model()
    cfg = json.loads((d / "config.json").read_text())
    yield AutoTokenizer.from_pretrained(d), int(cfg["vocab_size"]), list(cfg["eos_token_id"])


def generate(compiler: GrammarCompiler, stops: list[int], params: SamplingParams, seed: int,
             max_steps: int = 4000) -> list[int]:
    """Samples from random logits under the request's grammar until the grammar ends."""
    kind, spec = params.grammar or ("json_object", None)
    m = compiler.matcher(kind, spec)
    gen = torch.Generator().manual_seed(seed)
    logit_gen = torch.Generator().manual_seed(seed + 1000)
    sampler = Sampler(set(stops))
    out: list[int] = []
    for _ in range(max_steps):
        if m.terminated:
            break
        logits = torch.randn(1, compiler.vocab_size, generator=logit_gen) * 2
        out.append(sampler.sample(logits, [params], [out], generators=[gen],
                                  grammars=[m]).tokens[0])
    assert m.terminated, f"no end after {max_steps} tokens"
    assert out[-1] in stops
    return out[:-1]


@pytest.mark.parametrize("any_ws", [True, False])
@pytest.mark.parametrize("schema_i", range(len(SCHEMAS)))
def test_json_schema_output_parses_and_validates(demo: tuple[Any, int, list[int]], schema_i: int,
                                                 any_ws: bool) -> None:
    tok, vocab, stops = demo
    compiler = GrammarCompiler(tok, vocab, stops, any_whitespace=any_ws)
    schema = SCHEMAS[schema_i]
    params = SamplingParams(temperature=1.0, json_schema=json.dumps(schema), max_new_tokens=4000)
    for seed in range(6):
        text = tok.decode(generate(compiler, stops, params, seed))
        doc = json.loads(text)  # strict: no raw control characters in strings
        jsonschema.validate(doc, schema)
        if not any_ws:
            assert not re.search(r"[\t\r\n]", text), text


def test_json_object_regex_and_ebnf(demo: tuple[Any, int, list[int]]) -> None:
    tok, vocab, stops = demo
    c = GrammarCompiler(tok, vocab, stops, any_whitespace=False)
    # Any JSON object nests without bound: a bias towards closing it (and a logit_bias beside a
    # grammar is also a case to cover) makes the random walk end.
    close = {t: 4.0 for t in tok.convert_tokens_to_ids(["}", "]", '"'])}
    for seed in range(4):
        ids = generate(c, stops, SamplingParams(temperature=1.0, json_schema='{"type": "object"}',
                                                logit_bias=close, max_new_tokens=4000), seed)
        assert isinstance(json.loads(tok.decode(ids)), dict)
        text = tok.decode(generate(c, stops, SamplingParams(temperature=1.0,
                                                            regex=r"[a-z]{3}-\d{2,4}"), seed))
        assert re.fullmatch(r"[a-z]{3}-\d{2,4}", text), text
        text = tok.decode(generate(c, stops, SamplingParams(
            temperature=1.0, ebnf='root ::= ("yes" | "no") " " [0-9] [0-9]?'), seed))
        assert re.fullmatch(r"(yes|no) [0-9][0-9]?", text), text


def test_constrained_rows_leave_the_others_alone(demo: tuple[Any, int, list[int]]) -> None:
    tok, vocab, stops = demo
    c = GrammarCompiler(tok, vocab, stops)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    free = SamplingParams(temperature=1.0)
    alone = Sampler().sample(logits[[0, 2]], [free, free], [[], []], generators=[
        torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]).tokens
    m = c.matcher("regex", "[0-9]+")
    mixed = Sampler().sample(logits, [free, SamplingParams(regex="[0-9]+"), free], [[], [], []],
                             generators=[torch.Generator().manual_seed(s) for s in (1, 5, 2)],
                             grammars=[None, m, None])
    assert [mixed.tokens[0], mixed.tokens[2]] == alone
    assert tok.decode([mixed.tokens[1]]).isdigit()
    assert not m.accept(stops[0]) or m.terminated  # the matcher advanced past the digit


def test_bad_specs_are_config_errors(demo: tuple[Any, int, list[int]]) -> None:
    tok, vocab, stops = demo
    c = GrammarCompiler(tok, vocab, stops)
    for kind, spec, msg in [
        ("regex", "[a-z", "invalid regex: Regex parsing error at position 5: Unclosed '['"),
        ("ebnf", "root ::= ", "invalid ebnf: EBNF parser error at line 1, column 10"),
        ("json_schema", "{bad", "invalid json_schema: Expecting property name"),
        ("json_schema", '{"type": "nonsense"}', 'invalid json_schema: Unsupported type "nonsense"'),
        ("xml", "x", "unknown grammar kind 'xml'"),
    ]:
        with pytest.raises(ConfigError) as e:
            c.compile(kind, spec)
        assert str(e.value).startswith(msg), str(e.value)


def test_matcher_refuses_tokens_outside_the_grammar(demo: tuple[Any, int, list[int]]) -> None:
    tok, vocab, stops = demo
    m: Matcher = GrammarCompiler(tok, vocab, stops).matcher("regex", "ab")
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    assert not m.accept(b)
    assert m.accept(a) and m.accept(b) and not m.terminated
    assert m.accept(stops[0]) and m.terminated
    assert not m.accept(a)


def test_no_surrogates_and_no_raw_control_characters(demo: tuple[Any, int, list[int]]) -> None:
    """xgrammar 0.2.9 alone accepts the bytes ED BC 9F (a UTF-16 surrogate, invalid UTF-8) in a
    JSON string or for a regex `.`, and a raw \\x04 in a bounded JSON string; compiled here, no."""
    import xgrammar as xgr

    from engine.grammar import _utf8_only

    tok, vocab, stops = demo
    c = GrammarCompiler(tok, vocab, stops)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=stops)
    byte_tok = {v[0]: i for i, v in enumerate(info.decoded_vocab) if len(v) == 1}
    bounded = json.dumps({"type": "object", "properties": {"s": {"type": "string",
                                                                  "maxLength": 5}}})
    cases = [("json_schema", bounded, b'{"s": "', "é中😀"), ("json_object", None, b'{"', "é中😀"),
             ("regex", "a.b", b"a", "😀"), ("ebnf", 'root ::= [^x]+ "!"', b"", "é中😀")]
    raw = xgr.GrammarCompiler(info)
    for kind, spec, prefix, good in cases:
        for bad in (b"\xed\xbc\x9f", b"\x04"):
            if bad == b"\x04" and kind in ("regex", "ebnf"):
                continue  # a control character is fine where the grammar allows any character
            m = c.matcher(kind, spec)
            assert all(m.accept(byte_tok[b]) for b in prefix)
            assert not all(m.accept(byte_tok[b]) for b in bad), (kind, bad)
            m = c.matcher(kind, spec)
            assert all(m.accept(byte_tok[b]) for b in prefix + good.encode())
        if kind == "regex":  # the unpatched grammar does accept the surrogate (the reason)
            m2 = xgr.GrammarMatcher(raw.compile_regex(spec))
            assert all(m2.accept_token(byte_tok[b]) for b in b"a\xed\xbc\x9f")
    assert _utf8_only('root ::= "[^a" [^b] [\\0-\\U0010ffff]') == (
        'root ::= "[^a" [^\\ud800-\\udfffb] [^\\ud800-\\udfff]')


def test_demo_model_json_output_validates(demo: tuple[Any, int, list[int]]) -> None:
    """The demo model's own logits (transformers forward, greedy and sampled) under a bounded
    schema: the output parses and validates, and the grammar ends it."""
    from transformers import AutoModelForCausalLM

    tok, vocab, stops = demo
    model = AutoModelForCausalLM.from_pretrained(ensure_demo_model(), torch_dtype=torch.float32)
    model.eval()
    schema = SCHEMAS[0]
    c = GrammarCompiler(tok, vocab, stops, any_whitespace=False)
    prompt = tok.apply_chat_template([{"role": "user", "content": "A person as JSON."}],
                                     add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt, list):
        prompt = list(prompt["input_ids"])
    for temperature, seed in [(0.0, 0), (1.0, 1), (1.0, 2)]:
        params = SamplingParams(temperature=temperature, json_schema=json.dumps(schema),
                                max_new_tokens=200)
        m = c.matcher("json_schema", params.json_schema)
        gen = torch.Generator().manual_seed(seed)
        out: list[int] = []
        while not m.terminated:
            assert len(out) < params.max_new_tokens
            with torch.no_grad():
                logits = model(torch.tensor([prompt + out])).logits[:, -1, :].float()
            out.append(Sampler(set(stops)).sample(logits, [params], [out], generators=[gen],
                                                  grammars=[m]).tokens[0])
        assert out[-1] in stops
        jsonschema.validate(json.loads(tok.decode(out[:-1])), schema)
