"""How trace requests become token lists (for `HiRadixCache`) and page paths (for the analyses).

Both views describe the same thing, so the simulated cache and the one-pass analyses (MRC,
Belady, reuse distances, sharing) agree page for page:

* `prompt_output(req)` gives the `(prompt, output)` token lists handed to `simulate_request`.
* `paged(req)` gives a `PagedRequest`: the ids of the full pages the engine inserts after the
  request (prompt + output), of which the first `n_lookup` are the ones its lookup can hit.

Block traces (`mooncake`, `lmcache`): block `b` (a dense id) is `block_size` copies of token `b`,
so two different blocks never share a page and the tree matches exactly the blocks the trace says
are equal (every block has the same number of pages, so a sequence of page contents names one
sequence of blocks). Repeating one int object makes the token lists cheap to build. A block is always whole: Mooncake's last
block may be partial in the real prompt, but it is looked up as a whole block, and the request's
hit is capped at its input length (`min(block_size * k, input_length)`, the trace's own
accounting). The prompt handed to the cache is the blocks plus one unique token `u`: the engine
looks up `prompt[:-1]` (one token is always computed), so the extra token keeps every block
matchable. The output is `output_length` copies of `u`, which no later request can match.
`page_size` must divide `block_size`; page `j` of block `b` has id `b * (block_size // page_size)
+ j`.

Token traces (`engine`, `chat`, `completion`): the prompt and output are the real token ids (for
`chat` / `completion` the output is unknown: `max_tokens` unique ids). Page ids are interned
chains `(parent page id, page tokens)`, rooted per `extra_key`. The lookup covers the full pages
of `prompt[:-1]`; the insert covers the full pages of `prompt + output`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, repeat

from hicache_client.errors import ConfigError
from tools.hitrate.traces import Request, Trace

UNIQUE_TOKEN_BASE = 1 << 31  # synthetic tokens no trace block can produce
_MAX_BLOCK_TOKEN = UNIQUE_TOKEN_BASE


@dataclass(slots=True)
class PagedRequest:
    pages: list[int]  # ids of the full pages inserted after the request, root first
    n_lookup: int  # the first n_lookup pages are those its lookup can hit
    input_len: int  # prompt tokens (the hit cap)


class Layout:
    """Maps one trace's requests to token lists and page paths for one page size."""

    def __init__(self, trace: Trace, page_size: int, *, ignore_output: bool = False) -> None:
        self.trace = trace
        self.page_size = page_size
        self.ignore_output = ignore_output
        self.block = trace.block_size is not None
        if page_size < 1:
            raise ConfigError(f"page size must be >= 1, got {page_size}")
        if self.block:
            bs = trace.block_size or 0
            if bs % page_size:
                raise ConfigError(
                    f"page size {page_size} must divide the trace's block size {bs} "
                    f"(a block is {bs} tokens)"
                )
            if trace.num_blocks > _MAX_BLOCK_TOKEN:
                raise ConfigError(f"{trace.num_blocks} distinct blocks exceed the token space")
            self.per_block = bs // page_size
        self._next_unique_token = UNIQUE_TOKEN_BASE
        # Unique page ids (block traces) live above every block page id.
        self._next_unique_page = (trace.num_blocks + 1) * (getattr(self, "per_block", 1) or 1)
        self._intern: dict[tuple[int, tuple[int, ...]], int] = {}
        self._roots: dict[str | None, int] = {}

    def _bs_rep(self, blocks: list[int]) -> repeat[int]:
        return repeat(self.trace.block_size or 0, len(blocks))

    def _unique_tokens(self, n: int) -> list[int]:
        start = self._next_unique_token
        self._next_unique_token += n
        return list(range(start, start + n))

    def _n_output(self, req: Request) -> int:
        return 0 if self.ignore_output else req.output_len

    def prompt_output(self, req: Request) -> tuple[list[int], list[int]]:
        """The token lists `simulate_request` gets for this request."""
        if self.block:
            blocks = req.blocks or []
            # B copies of token b: one int object per block, so this is C-speed.
            prompt: list[int] = list(chain.from_iterable(map(repeat, blocks, self._bs_rep(blocks))))
            u = self._unique_tokens(1)[0]
            prompt.append(u)
            return prompt, [u] * self._n_output(req)
        assert req.prompt is not None
        if self.ignore_output:
            return req.prompt, []
        if req.output is not None:
            return req.prompt, req.output
        return req.prompt, self._unique_tokens(req.output_len)

    def paged(self, req: Request) -> PagedRequest:
        ps = self.page_size
        if self.block:
            m = self.per_block
            pages = [b * m + j for b in req.blocks or () for j in range(m)]
            n_lookup = len(pages)
            n_extra = (1 + self._n_output(req)) // ps
            start = self._next_unique_page
            self._next_unique_page += n_extra
            pages.extend(range(start, start + n_extra))
            return PagedRequest(pages, n_lookup, req.input_len)
        assert req.prompt is not None
        if self.ignore_output:
            tokens = req.prompt
        elif req.output is not None:
            tokens = req.prompt + req.output
        else:
            tokens = req.prompt + self._unique_tokens(req.output_len)
        root = self._roots.get(req.extra_key)
        if root is None:
            root = self._roots[req.extra_key] = -1 - len(self._roots)
        intern = self._intern
        pages = []
        parent = root
        for i in range(len(tokens) // ps):
            key = (parent, tuple(tokens[i * ps : (i + 1) * ps]))
            pid = intern.get(key)
            if pid is None:
                pid = intern[key] = len(intern)
            pages.append(pid)
            parent = pid
        return PagedRequest(pages, (req.input_len - 1) // ps, req.input_len)

    def all_paged(self) -> list[PagedRequest]:
        return [self.paged(r) for r in self.trace.requests]
