"""Structured output through xgrammar (the grammar library vLLM and SGLang use), on CPU or GPU.

    compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)   # once per model
    matcher = compiler.matcher("json_schema", schema_text)              # once per request
    # each decode step, for the batch's constrained rows (Sampler.sample does this):
    apply_grammars(logits, rows, matchers)      # disallowed tokens -> -inf, one batched call
    matcher.accept(token)                       # after sampling
    matcher.terminated                          # the grammar accepted a stop token: finish

Kinds: `json_schema` (a JSON schema, text), `json_object` (any JSON object: OpenAI's
`response_format: {"type": "json_object"}`), `regex`, `ebnf` (xgrammar's GBNF dialect, root rule
`root`). A grammar ends with one of the model's stop tokens, which the matcher accepts.

Two fixes over xgrammar 0.2.9, applied to the grammar's text before it is compiled (each found
by tests/engine/test_sampling_grammar.py on the demo tokenizer):

* JSON strings with a `maxLength`/`minLength` or a `pattern` let raw control characters
  (U+0000-U+001F, tab included) in, which `json.loads` refuses: those character classes are
  narrowed to what RFC 8259 allows.
* Negated character classes (`[^...]`, JSON string characters among them) and the any-character
  class (`[\0-\U0010ffff]`, a regex `.`) match UTF-16 surrogates U+D800-U+DFFF, i.e. the invalid
  UTF-8 bytes ED A0-BF xx: the output then decodes to U+FFFD replacement characters (and a
  `maxLength` string comes out too long). Those classes exclude the surrogates, for every kind.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import torch

from hicache_client.errors import ConfigError

KINDS = ("json_schema", "json_object", "regex", "ebnf")
# The character class xgrammar writes for the characters of a bounded JSON string, and the one
# RFC 8259 allows (no raw control characters).
_LOOSE_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_CHARS = '[^\\0-\\x1f\\"\\\\]'
_SURROGATES = "\\ud800-\\udfff"
_ANY_CHAR = "[\\0-\\U0010ffff]"
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[19:35:17] /project/cpp/x.cc:94: "


def _utf8_only(text: str) -> str:
    """The grammar `text` (xgrammar's EBNF, as it prints it) with no character class that
    matches a surrogate: `[^` gains the surrogate range, `[\\0-\\U0010ffff]` becomes its
    complement. Quoted literals are left alone."""
    out: list[str] = []
    i, n = 0, len(text)
    in_str = in_cls = False
    while i < n:
        ch = text[i]
        if ch == "\\":
            out.append(text[i : i + 2])
            i += 2
            continue
        if in_str:
            in_str = ch != '"'
        elif in_cls:
            in_cls = ch != "]"
        elif ch == '"':
            in_str = True
        elif text.startswith(_ANY_CHAR, i):
            out.append(f"[^{_SURROGATES}]")
            i += len(_ANY_CHAR)
            continue
        elif text.startswith("[^", i):
            out.append(f"[^{_SURROGATES}")
            in_cls = True
            i += 2
            continue
        elif ch == "[":
            in_cls = True
        out.append(ch)
        i += 1
    return "".join(out)


def _xgr() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - xgrammar is a core dependency
        raise ConfigError(f"structured output needs xgrammar ({e})") from None
    return xgrammar


class Matcher:
    """One request's grammar state."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        self._m = _xgr().GrammarMatcher(compiled)
        self.vocab_size = vocab_size

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, index)

    def accept(self, token: int) -> bool:
        """Advances past `token`; False (state unchanged) when the grammar does not allow it."""
        if self._m.is_terminated():
            return False
        return bool(self._m.accept_token(int(token)))

    @property
    def terminated(self) -> bool:
        return bool(self._m.is_terminated())


class GrammarCompiler:
    """Compiles grammars for one tokenizer (a Hugging Face tokenizer) and the model's logits
    width `vocab_size`; compiled grammars are cached by (kind, spec). `any_whitespace`: JSON
    may carry any whitespace between tokens (SGLang's and vLLM's default); False allows none
    but the separators `", "` and `": "`, which keeps a weak model from padding forever."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        any_whitespace: bool = True,
    ) -> None:
        xgr = _xgr()
        self.vocab_size = vocab_size
        self.any_whitespace = any_whitespace
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info)
        self._cache: dict[tuple[str, str], Any] = {}

    def compile(self, kind: str, spec: str | None = None) -> Any:
        key = (kind, spec or "")
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        xgr = _xgr()
        try:
            if kind in ("json_schema", "json_object"):
                schema = spec if kind == "json_schema" else '{"type": "object"}'
                if kind == "json_schema":
                    json.loads(schema or "")  # a clear error for text that is not JSON
                text = str(
                    xgr.Grammar.from_json_schema(
                        schema, strict_mode=True, any_whitespace=self.any_whitespace
                    )
                ).replace(_LOOSE_CHARS, _JSON_CHARS)
            elif kind == "regex":
                text = str(xgr.Grammar.from_regex(spec or ""))
            elif kind == "ebnf":
                text = str(xgr.Grammar.from_ebnf(spec or ""))
            else:
                raise ConfigError(f"unknown grammar kind {kind!r}; known: {', '.join(KINDS)}")
            compiled = self._compiler.compile_grammar(xgr.Grammar.from_ebnf(_utf8_only(text)))
        except ConfigError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with its message
            msg = _LOG_PREFIX.sub("", str(e).strip().splitlines()[0])
            raise ConfigError(f"invalid {kind}: {msg[:300]}") from None
        self._cache[key] = compiled
        return compiled

    def matcher(self, kind: str, spec: str | None = None) -> Matcher:
        return Matcher(self.compile(kind, spec), self.vocab_size)


def apply_grammars(logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[Matcher]) -> None:
    """Sets the logits of tokens that `matchers[j]` does not allow next to -inf in row
    `rows[j]` of `logits` ([B, vocab], in place): each matcher fills its row of one bitmask,
    which is applied to all rows in one call."""
    if not rows:
        return
    xgr = _xgr()
    b, vocab = logits.shape
    bitmask = xgr.allocate_token_bitmask(b, vocab)
    for i, m in zip(rows, matchers):
        m.fill_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=list(rows))
