"""`Req`: one request's state in the scheduler."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.detokenizer import TextStream
from engine.req_logprobs import ReqLogprobs
from engine.sampling import SamplingParams
from hicache.admission import NO_HINTS, CacheHints
from hicache.prefix_cache import Acquired
from hicache.radix import TreeNode

if TYPE_CHECKING:
    from engine.grammar import Matcher

FinishReason = dict[str, Any]


@dataclass
class Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    extra_key: str | None = None
    cache_hints: CacheHints = NO_HINTS  # skip_cache_write, retention_seconds, priority
    arrival: float = field(default_factory=time.time)
    output: list[int] = field(default_factory=list)
    kv_len: int = 0  # leading tokens whose K/V is in `pages`
    pages: list[int] = field(default_factory=list)  # page table
    tree_pages: int = 0  # leading pages owned by the tree (pinned by `node`)
    node: TreeNode | None = None  # locked tree node (None: nothing locked)
    admission: Acquired | None = None  # the cache's answer at the latest admission
    cached_tokens: int = -1  # prompt tokens served by the cache at first admission
    # Its prompt tokens by outcome at first admission (hicache.attribution), set when it ends.
    cache_outcomes: dict[str, int] | None = None
    generator: torch.Generator | None = None
    finish_reason: FinishReason | None = None
    text: str = ""  # the output text, cut at a stop string (set when the request finishes)
    detok: TextStream | None = None  # incremental detokenizer and stop strings (engine.detokenizer)
    sent_tokens: int = 0  # output tokens already reported by step()
    first_token_time: float | None = None
    retractions: int = 0
    logprobs: ReqLogprobs | None = None  # logprobs asked for (engine.req_logprobs)
    matcher: Matcher | None = None  # structured-output grammar state (engine.grammar)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def match_len(self) -> int:
        """Leading tokens the cache may serve: all but the last (its logits are needed), fewer
        while prompt logprobs are pending (engine.req_logprobs)."""
        n = len(self.prompt) + len(self.output) - 1
        return self.logprobs.cache_limit(n) if self.logprobs is not None else n

    def append_token(
        self, tok: int, eos_token_ids: Any, decode_text: Any, context_length: int
    ) -> FinishReason | None:
        """Add the sampled `tok` to the output; why the request ends with it (None: it goes on).
        `eos_token_ids`: the model's EOS ids; `decode_text`: ids -> text (`TextStream`)."""
        if self.first_token_time is None:
            self.first_token_time = time.time()
        self.output.append(tok)
        p = self.params
        reason: FinishReason | None = None
        if not p.ignore_eos and tok in eos_token_ids or tok in p.stop_token_ids:
            reason = {"type": "stop", "matched": tok}
        if self.detok is None:
            self.detok = TextStream(decode_text, skip_special_tokens=p.skip_special_tokens,
                                    stop=p.stop, trim=not p.no_stop_trim)
        # Stop strings count once min_tokens are out (EOS and stop ids: the sampler holds
        # them back until then); a grammar that reached its end finishes the request. The text
        # of a stop token (EOS, stop_token_ids) is not output unless no_stop_trim.
        matched = None
        if reason is None or p.no_stop_trim:
            matched = self.detok.push(
                self.output, check_stop=reason is None and len(self.output) >= p.min_tokens
            )
        if reason is None and matched is None and self.matcher is not None \
                and self.matcher.terminated:
            reason = {"type": "stop", "matched": tok}
        if matched is not None:
            reason = {"type": "stop", "matched": matched}
        if reason is None and len(self.output) >= p.max_new_tokens:
            reason = {"type": "length", "length": p.max_new_tokens}
        if reason is None and len(self.tokens) >= context_length:
            reason = {"type": "length", "length": len(self.output)}
        if reason is not None:
            self.detok.finish()
            self.text = self.detok.text
        return reason

    def settle_load(self) -> None:
        """Pages loaded back for this request may be given back before a forward read them
        (abort, no room): make later work wait for their layer-wise load first."""
        if self.admission is not None and self.admission.load is not None:
            self.admission.load.wait_all()
