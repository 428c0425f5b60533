"""What every route shares: the tokenizer, the scheduler client, the model's limits, and the
bounded path from request bytes to token ids.

A body is read as it streams in and refused with a 413 once it passes `MAX_BODY_BYTES`
(Content-Length or chunked); all bodies being read or parsed at once hold at most
`BODY_BUDGET_BYTES` (more is a 503). JSON parsing, validation and tokenization run on worker
threads, never on the event loop (the JSON parser and the tokenizer release the GIL), so
`/health` and other clients stay responsive while a large request is parsed. A text prompt whose
length in characters makes it certainly longer than the context is refused before it is
tokenized: no token covers more than `max_token_chars` characters.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from engine.args import EngineArgs
from engine.sampling import SamplingParams
from engine.server import protocol as P
from engine.server.client import SchedulerClient
from engine.server.generation import Generation
from engine.server.metrics import ServerMetrics
from engine.server.schemas import ApiError, bad, load_json, validate
from engine.tokenizer import Tokenizer
from hicache_client.errors import ConfigError

T = TypeVar("T")

# Largest request body (a bigger one is a 413, counted while it streams in).
MAX_BODY_BYTES = 64 << 20
# All request bodies being read or parsed at one time hold at most this much (then a 503).
BODY_BUDGET_BYTES = 4 * MAX_BODY_BYTES
# Worker threads that parse and tokenize request bodies.
PARSE_THREADS = 2
# Generations one request may ask for (prompts x n).
MAX_GENERATIONS = 1024


@dataclass
class ServerState:
    args: EngineArgs
    tokenizer: Tokenizer
    client: SchedulerClient
    info: P.Ready
    model_name: str
    metrics: ServerMetrics | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    body_bytes: int = 0  # bytes of bodies being read or parsed now
    max_token_chars: int = 0
    _pool: ThreadPoolExecutor | None = None
    _tok_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.max_token_chars = self.tokenizer.max_token_chars()
        self._pool = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="parse")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ---- bodies -------------------------------------------------------------------------------

    async def parse(self, request: Request, model: type[Any],
                    then: Callable[[Any], T] | None = None) -> tuple[Any, T | None]:
        """Read the body (bounded), then on a worker thread decode and validate it as `model`
        and run `then(body)` (tokenization and checks). Returns (body, then's result)."""
        raw = await self._read(request)
        allow = self.args.allow_unknown_fields

        def work() -> tuple[Any, T | None]:
            body = validate(load_json(raw), model, allow)
            return body, then(body) if then is not None else None

        try:
            return await self.in_worker(work)
        finally:
            self.body_bytes -= len(raw)

    async def _read(self, request: Request) -> bytes:
        too_big = ApiError(413, f"the body is larger than {MAX_BODY_BYTES} bytes",
                           code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise too_big
        chunks: list[bytes] = []
        n = 0
        try:
            async for chunk in request.stream():
                n += len(chunk)
                self.body_bytes += len(chunk)
                if n > MAX_BODY_BYTES:
                    raise too_big
                if self.body_bytes > BODY_BUDGET_BYTES:
                    raise ApiError(503, "too many large request bodies in flight; retry later",
                                   type="server_error", code="overloaded")
                chunks.append(chunk)
        except BaseException:
            self.body_bytes -= n
            raise
        return b"".join(chunks)

    # ---- prompts (called on worker threads) ---------------------------------------------------

    def check_prompt(self, ids: Sequence[int], param: str = "prompt") -> None:
        info = self.info
        if not ids:
            raise bad("the prompt is empty", param)
        if len(ids) >= info.context_length:
            raise bad(f"the prompt has {len(ids)} tokens; this model's context length is "
                      f"{info.context_length}", param, code="context_length_exceeded")
        if len(ids) + 1 > info.max_total_tokens:
            raise bad(f"the prompt has {len(ids)} tokens; the KV pool holds "
                      f"{info.max_total_tokens}", param, code="context_length_exceeded")
        bad_ids = [t for t in ids if not 0 <= t < info.vocab_size]
        if bad_ids:
            raise bad(f"token ids out of the vocabulary (size {info.vocab_size}): {bad_ids[:5]}",
                      param)

    def check_chars(self, n_chars: int, param: str) -> None:
        """Refuse, without tokenizing, text that has more characters than the context can hold
        tokens of."""
        limit = self.max_token_chars * min(self.info.context_length, self.info.max_total_tokens)
        if n_chars > limit:
            raise bad(f"the prompt has {n_chars} characters, more than {limit} (a token holds "
                      f"at most {self.max_token_chars}): it is longer than the context of "
                      f"{self.info.context_length} tokens", param, code="context_length_exceeded")

    def tokenize(self, prompt: str | list[int], param: str = "prompt", *,
                 add_special_tokens: bool = True, truncate: int | None = None) -> list[int]:
        """`prompt`'s ids, checked; `add_special_tokens=False`: no BOS (vLLM's
        `add_special_tokens`); `truncate`: keep the last k tokens (`truncate_prompt_tokens`)."""
        if isinstance(prompt, str):
            if truncate is None:
                self.check_chars(len(prompt), param)
            try:
                with self._tok_lock:
                    ids = self.tokenizer.encode(prompt) if add_special_tokens else \
                        list(self.tokenizer.hf.encode(prompt, add_special_tokens=False))
            except ConfigError as e:  # no tokenizer (a dummy-weight model): send token ids
                raise bad(str(e), param) from e
        else:
            ids = list(prompt)
        ids = self.truncate(ids, truncate)
        self.check_prompt(ids, param)
        return ids

    def truncate(self, ids: list[int], k: int | None,
                 param: str = "truncate_prompt_tokens") -> list[int]:
        """The last `k` of `ids` (vLLM's `truncate_prompt_tokens`; -1: as many as the context
        takes with one token to generate)."""
        if k is None:
            return ids
        limit = min(self.info.context_length, self.info.max_total_tokens) - 1
        if k == -1:
            k = limit
        if not 1 <= k <= limit:
            raise bad(f"{param} must be -1 or in 1..{limit} (the context length less one), "
                      f"got {k}", param)
        return ids[-k:]

    def words_ids(self, words: Sequence[str], param: str = "bad_words") -> list[list[int]]:
        """vLLM's `bad_words` as token sequences: each word alone and after a space (when that
        gives another first token and as many tokens), no special tokens."""
        out: list[list[int]] = []
        with self._tok_lock:
            for word in words:
                if not word.strip():
                    raise bad(f"{param}: an empty word", param)
                try:
                    plain = list(self.tokenizer.hf.encode(word.lstrip(),
                                                          add_special_tokens=False))
                    spaced = list(self.tokenizer.hf.encode(" " + word.lstrip(),
                                                           add_special_tokens=False))
                except ConfigError as e:
                    raise bad(str(e), param) from e
                out.append(plain)
                if spaced[0] != plain[0] and len(spaced) == len(plain):
                    out.append(spaced)
        return out

    def chat_ids(self, messages: list[dict[str, str]], param: str = "messages",
                 template_kwargs: dict[str, Any] | None = None, *,
                 add_generation_prompt: bool = True, continue_final_message: bool = False,
                 add_special_tokens: bool = False, truncate: int | None = None) -> list[int]:
        """The chat template over `messages` (with its generation prompt unless
        `add_generation_prompt=False`; `continue_final_message`: the last message left open, as
        transformers does it); `template_kwargs`: extra variables of the template (SGLang's
        `chat_template_kwargs`); `add_special_tokens`: the rendered text tokenized with them
        (vLLM's; by default the template's own are all); `truncate`: the last k tokens."""
        if truncate is None:
            self.check_chars(sum(len(m["content"]) + len(m["role"]) for m in messages), param)
        kw = dict(template_kwargs or {})
        if continue_final_message:
            kw["continue_final_message"] = True
        try:
            with self._tok_lock:
                if add_special_tokens:
                    text = self.tokenizer.apply_chat_template(
                        messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                        **kw)
                    ids = list(self.tokenizer.hf.encode(text, add_special_tokens=True))
                else:
                    ids = self.tokenizer.apply_chat_template(
                        messages, add_generation_prompt=add_generation_prompt, **kw)
        except ConfigError as e:
            raise bad(str(e), param) from e
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise bad(f"the chat template failed on these messages: {e}", param) from e
        assert isinstance(ids, list)
        ids = self.truncate(ids, truncate)
        self.check_prompt(ids, param)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        with self._tok_lock:
            return self.tokenizer.decode(ids)

    def sampling(
        self, *, max_tokens: int | None, param: str, prompt_len: int, temperature: float | None,
        top_p: float | None, top_k: int | None, stop: str | list[str] | None,
        stop_token_ids: list[int] | None, seed: int | None, ignore_eos: bool | None,
        skip_special_tokens: bool | None, extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """`extra`: further `SamplingParams` fields (engine.server.openai_params)."""
        ctx = self.info.context_length
        if max_tokens is None:
            max_tokens = ctx - prompt_len
        if max_tokens < 0:
            raise bad(f"{param} must be >= 0, got {max_tokens}", param)
        if max_tokens > ctx:
            raise bad(f"{param} is {max_tokens}; the context length is {ctx}", param)
        given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
                 "ignore_eos": ignore_eos, "skip_special_tokens": skip_special_tokens,
                 "stop_token_ids": list(stop_token_ids) if stop_token_ids is not None else None,
                 "stop": ([stop] if isinstance(stop, str) else list(stop))
                 if stop is not None else None}
        sp: dict[str, Any] = {"max_new_tokens": max_tokens}
        sp.update({k: v for k, v in given.items() if v is not None})
        sp.update(extra or {})
        try:
            params = SamplingParams(**sp)
        except (ConfigError, TypeError, ValueError) as e:
            raise bad(str(e), "sampling_params") from e
        sp["stop"] = params.stop
        return sp

    def check_n(self, n: int, n_prompts: int, param: str = "n") -> None:
        if not 1 <= n <= self.args.max_running_requests:
            raise bad(f"{param} must be in 1..{self.args.max_running_requests} (the engine's "
                      f"--max-running-requests), got {n}", param)
        if n * n_prompts > MAX_GENERATIONS:
            raise bad(f"{n_prompts} prompts x n={n} is more than {MAX_GENERATIONS} generations "
                      "in one request", param)

    # ---- generations (on the event loop) ------------------------------------------------------

    def generation(self, ids: list[int], params: dict[str, Any], extra_key: str | None = None,
                   *, index: int = 0, client_rid: str | None = None) -> Generation:
        return Generation(self, ids, params, extra_key, index=index, client_rid=client_rid)

    def samples(self, ids: list[int], params: dict[str, Any], extra_key: str | None, n: int,
                first_index: int, client_rid: str | None = None) -> list[Generation]:
        """`n` generations of one prompt; with a seed, sample j uses seed + j (distinct
        samples, reproducible)."""
        out = []
        for j in range(n):
            p = dict(params)
            if n > 1 and p.get("seed") is not None:
                p["seed"] = int(p["seed"]) + j
            out.append(self.generation(ids, p, extra_key, index=first_index + j,
                                       client_rid=client_rid))
        return out
