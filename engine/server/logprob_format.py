"""Logprobs as the HTTP APIs show them, from the scheduler's `ReqOut.logprobs` increments.

`LogprobTrack` gathers one generation's logprobs (prompt, once; output, per update). Shapes:

* completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`;
  with `echo` the prompt's tokens come first (token 0 has logprob null, as OpenAI shows it);
* chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}], "refusal": null}`;
* SGLang `meta_info`: `input_token_logprobs` / `output_token_logprobs` as `[logprob, id, text]`
  (text null unless `return_text_in_logprobs`), `input_top_logprobs` / `output_top_logprobs`
  as lists of those per token.

A token's text is its own decode (special tokens included); a token that is part of a
multi-byte character shows as U+FFFD, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

TokenText = Callable[[int], str]
Pairs = list[tuple[int, float]]


@dataclass
class LogprobTrack:
    output: list[float] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    output_top: list[Pairs] = field(default_factory=list)
    prompt: list[float | None] = field(default_factory=list)
    prompt_top: list[Pairs | None] = field(default_factory=list)
    prompt_start: int = -1

    def add(self, lp: dict[str, Any] | None, new_ids: Sequence[int]) -> int:
        """Take one `ReqOut.logprobs`; returns the index of its first output entry."""
        first = len(self.output)
        if lp is None:
            return first
        out = list(lp.get("output") or [])
        self.output.extend(float(x) for x in out)
        self.output_ids.extend(int(t) for t in list(new_ids)[: len(out)])
        self.output_top.extend([(int(t), float(v)) for t, v in x]
                               for x in lp.get("output_top") or [])
        if "prompt" in lp:
            self.prompt_start = int(lp.get("prompt_start", 0))
            self.prompt = [None if x is None else float(x) for x in lp["prompt"]]
            self.prompt_top = [None if x is None else [(int(t), float(v)) for t, v in x]
                               for x in lp["prompt_top"]]
        return first


def completion_logprobs(track: LogprobTrack, text: TokenText, first: int = 0,
                        prompt_ids: Sequence[int] | None = None, top: bool = True,
                        offset: int = 0, k: int | None = None) -> dict[str, Any]:
    """OpenAI completions' `logprobs` for output entries `first:` (and the prompt's first when
    `prompt_ids` is given: echo). `offset`: the text offset of the first token; `k`: at most
    this many alternatives per token (the track may hold more, for `prompt_logprobs`)."""
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []

    def put(tok: int, lp: float | None, alts: Pairs | None) -> None:
        nonlocal offset
        s = text(tok)
        tokens.append(s)
        lps.append(lp)
        tops.append(None if alts is None else {text(t): v for t, v in alts[:k]})
        offsets.append(offset)
        offset += len(s)

    if prompt_ids is not None:
        start = max(track.prompt_start, 0)
        for j, tok in enumerate(prompt_ids[start:]):
            put(tok, track.prompt[j] if j < len(track.prompt) else None,
                track.prompt_top[j] if j < len(track.prompt_top) else None)
    for i in range(first, len(track.output)):
        put(track.output_ids[i], track.output[i], track.output_top[i])
    return {"tokens": tokens, "token_logprobs": lps,
            "top_logprobs": tops if top else None, "text_offset": offsets}


def _chat_entry(text: TokenText, tok: int, lp: float) -> dict[str, Any]:
    s = text(tok)
    return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(track: LogprobTrack, text: TokenText, first: int = 0,
                  k: int | None = None) -> dict[str, Any]:
    """OpenAI chat's `logprobs` for output entries `first:` (`k`: at most k alternatives)."""
    content = []
    for i in range(first, len(track.output)):
        e = _chat_entry(text, track.output_ids[i], track.output[i])
        e["top_logprobs"] = [_chat_entry(text, t, v) for t, v in track.output_top[i][:k]]
        content.append(e)
    return {"content": content, "refusal": None}


def prompt_logprobs(track: LogprobTrack, text: TokenText, prompt_ids: Sequence[int],
                    k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first: null) its logprob and the top k
    others, `{token id: {"logprob", "rank", "decoded_token"}}`; rank is 1-based among the
    alternatives, null for a prompt token outside the top k (its exact rank is not computed)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for j, tok in enumerate(prompt_ids):
        lp = track.prompt[j] if j < len(track.prompt) else None
        if lp is None:
            out.append(None)
            continue
        alts = (track.prompt_top[j] or [])[:k] if j < len(track.prompt_top) else []
        ranks = {t: r + 1 for r, (t, _) in enumerate(alts)}
        entry = {str(tok): {"logprob": lp, "rank": ranks.get(tok), "decoded_token": text(tok)}}
        for t, v in alts:
            entry.setdefault(str(t), {"logprob": v, "rank": ranks[t], "decoded_token": text(t)})
        out.append(entry)
    return out


def sglang_meta(track: LogprobTrack, text: TokenText | None,
                prompt_ids: Sequence[int]) -> dict[str, Any]:
    """SGLang's logprob entries of `meta_info` (all of them so far)."""

    def entry(lp: float | None, tok: int) -> list[Any]:
        return [lp, tok, text(tok) if text is not None else None]

    def tops(alts: Pairs | None) -> list[list[Any]] | None:
        return None if alts is None else [entry(v, t) for t, v in alts]

    start = max(track.prompt_start, 0)
    in_ids = list(prompt_ids[start:]) if track.prompt_start >= 0 else []
    return {
        "input_token_logprobs": [entry(lp, t) for lp, t in zip(track.prompt, in_ids)],
        "input_top_logprobs": [tops(x) for x in track.prompt_top],
        "output_token_logprobs": [entry(lp, t) for lp, t in zip(track.output,
                                                                track.output_ids)],
        "output_top_logprobs": [tops(x) for x in track.output_top],
    }


def make_token_text(tokenizer: Any, lock: Any) -> TokenText:
    """A cached `id -> text` of single tokens (special tokens shown), decoding under `lock` (the
    tokenizer is shared with the worker threads)."""
    cache: dict[int, str] = {}

    def text(tok: int) -> str:
        s = cache.get(tok)
        if s is None:
            with lock:
                s = str(tokenizer.decode([tok], skip_special_tokens=False))
            if len(cache) < 1 << 18:
                cache[tok] = s
        return s

    return text
