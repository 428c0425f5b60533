"""One generation as the routes see it: send a request to the scheduler, turn its outputs into
`Update`s (the one request-update type), and the helpers every route shares: batches, parallel
sampling that computes a prompt once, client disconnects, and the one SSE stream helper.

The text comes from the scheduler (`ReqOut.text`: it owns detokenization and stop strings); the
front end only concatenates it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse

from engine.server import protocol as P
from engine.server.logprob_format import LogprobTrack
from engine.server.schemas import ApiError

if TYPE_CHECKING:
    from engine.server.client import SchedulerClient
    from engine.server.metrics import ServerMetrics


class ServerState(Protocol):
    """What a generation uses of `engine.server.state.ServerState` (no import of it: the state
    builds generations, so importing it here would be a circle)."""

    @property
    def client(self) -> SchedulerClient: ...

    @property
    def metrics(self) -> ServerMetrics | None: ...

logger = logging.getLogger(__name__)

# How often a non-streaming request checks whether its client is still connected.
DISCONNECT_POLL_S = 0.5


@dataclass
class Update:
    """What a route sees of one generation after each scheduler step."""

    index: int  # the choice index in the response
    delta: str  # text released since the previous update
    text: str  # all text so far
    output_ids: list[int]  # all output ids so far (the generation's own list: do not mutate)
    finished: bool
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    rid: str  # the client's name of the request (its `rid`) or the engine's id
    # Logprobs gathered so far (engine.server.logprob_format) and the first output entry new
    # in this update; None when the request asked for none.
    logprobs: LogprobTrack | None = None
    lp_first: int = 0
    # The prompt's tokens by hit tier / miss cause, on the final update (hicache.attribution).
    cache_outcomes: dict[str, int] | None = None

    @property
    def meta_info(self) -> dict[str, Any]:
        return {"id": self.rid, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
                "finish_reason": self.finish_reason}


@dataclass
class Generation:
    state: ServerState
    input_ids: list[int]
    params: dict[str, Any]
    extra_key: str | None = None
    index: int = 0
    client_rid: str | None = None
    metered: bool = True  # counted in /metrics (not the prompt-only request of n > 1)
    rid: str = ""  # the engine's id: unique, never the client's
    queue: asyncio.Queue[Any] | None = None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    t0: float = field(default_factory=time.monotonic)
    t_last: float | None = None
    first: Any = None
    logprobs: dict[str, int] | None = None  # GenerateReq.logprobs (engine.server.openai_params)
    cache_hints: dict[str, Any] | None = None  # GenerateReq.cache_hints (schemas.cache_hints)
    track: LogprobTrack = field(default_factory=LogprobTrack)

    def __post_init__(self) -> None:
        self.rid = self.state.client.new_id()

    async def start(self) -> None:
        """Send the request and wait for its first answer, so that the scheduler's refusal
        becomes a 400 before any streaming response begins."""
        client = self.state.client
        self.queue = client.open(self.rid)
        try:
            await client.send(P.GenerateReq(rid=self.rid, input_ids=self.input_ids,
                                            sampling_params=self.params,
                                            extra_key=self.extra_key, logprobs=self.logprobs,
                                            cache_hints=self.cache_hints))
            self.first = await self.queue.get()
        except BaseException:
            self.abort()
            raise
        if isinstance(self.first, P.ReqError):
            client.close(self.rid)
            self.finished = True
            status = self.first.status
            raise ApiError(status, self.first.message,
                           type="invalid_request_error" if status < 500 else "server_error",
                           code="invalid_value" if status < 500 else "unavailable")

    def abort(self) -> None:
        """Stop the request in the scheduler (no await: safe while being cancelled)."""
        client = self.state.client
        client.close(self.rid)
        if not self.finished:
            self.finished = True
            client.send_nowait(P.AbortReq(rid=self.rid))
            if self.state.metrics is not None and self.metered:
                self.state.metrics.aborted.inc()

    def _update(self, out: P.ReqOut) -> Update:
        now = time.monotonic()
        m = self.state.metrics if self.metered else None
        n_new = len(out.new_token_ids)
        if m is not None and n_new:
            if self.t_last is None:
                m.first_token(now - self.t0, out.prompt_tokens, out.cached_tokens)
                for _ in range(n_new - 1):
                    m.itl.observe(0.0)
            else:
                gap = (now - self.t_last) / n_new
                for _ in range(n_new):
                    m.itl.observe(gap)
        if n_new:
            self.t_last = now
        lp_first = self.track.add(out.logprobs, out.new_token_ids)
        self.output_ids.extend(out.new_token_ids)
        self.text += out.text
        if out.finished:
            self.finished = True
            self.state.client.close(self.rid)
            if m is not None:
                m.finished(out.prompt_tokens, out.completion_tokens, out.cached_tokens,
                           now - self.t0)
        return Update(index=self.index, delta=out.text, text=self.text,
                      output_ids=self.output_ids, finished=out.finished,
                      finish_reason=out.finish_reason, prompt_tokens=out.prompt_tokens,
                      completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens,
                      rid=self.client_rid or self.rid,
                      logprobs=self.track if self.logprobs is not None else None,
                      lp_first=lp_first, cache_outcomes=out.cache_outcomes)

    async def updates(self) -> AsyncIterator[Update]:
        assert self.queue is not None
        item = self.first
        try:
            while True:
                if isinstance(item, P.ReqError):
                    raise ApiError(item.status, item.message, type="server_error",
                                   code="unavailable")
                upd = self._update(item)
                yield upd
                if upd.finished:
                    return
                item = await self.queue.get()
        finally:
            self.abort()  # no-op once finished

    async def result(self) -> Update:
        last: Update | None = None
        async for u in self.updates():
            last = u
        assert last is not None
        return last


# ---- batches and parallel sampling --------------------------------------------------------------


async def _settle(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel what still runs and retrieve every outcome (no 'exception never retrieved')."""
    for t in tasks:
        if not t.done():
            t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def start_all(gens: list[Generation]) -> None:
    """Send every request of a batch before waiting for any, so they are batched together; on
    any refusal abort the others and raise it."""
    tasks = [asyncio.ensure_future(g.start()) for g in gens]
    try:
        got = await asyncio.gather(*tasks, return_exceptions=True)
    except BaseException:
        for g in gens:
            g.abort()
        await _settle(tasks)
        raise
    errors = [e for e in got if isinstance(e, BaseException)]
    if errors:
        for g in gens:
            g.abort()
        raise errors[0]


async def prefill_prompts(state: ServerState, prompts: list[tuple[list[int], str | None]],
                          cache_hints: dict[str, Any] | None = None) -> list[int]:
    """Compute each prompt once (a request with max_new_tokens=0, as SGLang's parallel sampling
    does), so that the n samples sent next find its pages in the radix tree instead of each
    computing it. Returns the tokens of each prompt that were already cached."""
    gens = [Generation(state, ids, {"max_new_tokens": 0}, key, metered=False,
                       cache_hints=cache_hints) for ids, key in prompts]
    await start_all(gens)
    tasks = [asyncio.ensure_future(g.result()) for g in gens]
    try:
        done = await asyncio.gather(*tasks)
    finally:
        for g in gens:
            g.abort()
        await _settle(tasks)
    return [u.cached_tokens for u in done]


async def results_or_abort(request: Request, gens: list[Generation]) -> list[Update]:
    """The final updates of `gens`; when the client goes away first, abort them (their KV
    pages are freed at once instead of when the answer nobody reads is complete)."""
    tasks = [asyncio.ensure_future(g.result()) for g in gens]
    try:
        while True:
            _, pending = await asyncio.wait(tasks, timeout=DISCONNECT_POLL_S)
            if not pending:
                return [t.result() for t in tasks]
            if await request.is_disconnected():
                raise ApiError(499, "the client closed the connection", code="client_closed")
    finally:
        for g in gens:
            g.abort()
        await _settle(tasks)


async def merged(gens: list[Generation]) -> AsyncIterator[Update]:
    """The updates of several generations, interleaved as they arrive."""
    if len(gens) == 1:
        async for u in gens[0].updates():
            yield u
        return
    queue: asyncio.Queue[Update | BaseException | None] = asyncio.Queue()

    async def pump(g: Generation) -> None:
        try:
            async for u in g.updates():
                await queue.put(u)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await queue.put(e)
        else:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(g)) for g in gens]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for g in gens:
            g.abort()
        await _settle(tasks)


# ---- shapes shared by the routes -------------------------------------------------------------


def finish_reason_str(reason: Mapping[str, Any] | None) -> str | None:
    if reason is None:
        return None
    t = reason.get("type")
    return "length" if t == "length" else "abort" if t == "abort" else "stop"


def check_aborted(u: Update) -> None:
    reason = u.finish_reason or {}
    if reason.get("type") == "abort":
        raise ApiError(400, str(reason.get("message", "the request was aborted")),
                       code="request_aborted")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sse_response(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """The one SSE stream: `data: JSON` per event, an error event if the generation fails
    midway, then `data: [DONE]`. A client that goes away cancels the stream; the generations
    behind `events` are aborted by their own cleanup."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for obj in events:
                yield b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
        except ApiError as e:
            yield b"data: " + json.dumps(e.body()).encode() + b"\n\n"
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()  # type: ignore[attr-defined]
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")
