"""The HTTP front end: a FastAPI app with the tokenizer and detokenizer in this process.

Prompts are tokenized here and sent to the scheduler process as token ids (`GenerateReq`); the
scheduler streams new token ids back (`BatchOut`) and this process turns them into text,
applies stop strings and speaks OpenAI's and SGLang's HTTP shapes. Every bad request is a 400
with an OpenAI-style body `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.args import EngineArgs
from engine.sampling import SamplingParams
from engine.server import protocol as P
from engine.server.metrics import ServerMetrics
from engine.tokenizer import Tokenizer
from hicache.errors import ConfigError

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT = 120.0
# How often a non-streaming request checks whether its client is still connected.
DISCONNECT_POLL_S = 0.5
# Largest request body read (a bigger one is a 413 before it is read).
MAX_BODY_BYTES = 64 << 20


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


# ---------------------------------------------------------------------------------------------
# request bodies (strict: a wrong type is a 400, not a coercion)
# ---------------------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAISampling(_Body):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: bool | int | None = None
    user: str | None = None
    # Cache isolation (a tenant salt): requests with different salts never share pages.
    cache_salt: str | None = None


class CompletionBody(_OpenAISampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None


class ChatBody(_OpenAISampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class GenerateSampling(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None


class GenerateBody(_Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSampling | None = None
    stream: bool = False
    rid: str | None = None
    extra_key: str | None = None


class StorageBody(_Body):
    backend: str
    extra_config: dict[str, Any] | None = None


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"the body is larger than {MAX_BODY_BYTES} bytes",
                       code="request_too_large")
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"the body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(data, dict):
        raise bad("the body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err.get("loc", ())) or None
        raise bad(f"{param}: {err.get('msg')}" if param else str(err.get("msg")), param) from e


# ---------------------------------------------------------------------------------------------
# the scheduler connection
# ---------------------------------------------------------------------------------------------


class SchedulerClient:
    """PUSH requests to the scheduler, PULL its outputs; route them to per-request queues."""

    def __init__(self, ctx: zmq.asyncio.Context, in_addr: str, out_addr: str) -> None:
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.bind(in_addr)
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(out_addr)
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        self.controls: dict[str, asyncio.Future[P.ControlResp]] = {}
        self.ready: asyncio.Future[P.Ready] = asyncio.get_running_loop().create_future()
        self.dead: str | None = None

    async def recv_loop(self) -> None:
        while True:
            frame = await self.pull.recv()
            try:
                msg = P.decode(frame)
            except P.ProtocolError as e:
                logger.error("dropping a malformed frame from the scheduler: %s", e)
                continue
            if isinstance(msg, P.BatchOut):
                for out in msg.outputs:
                    q = self.queues.get(out.rid)
                    if q is not None:
                        q.put_nowait(out)
            elif isinstance(msg, P.ReqError):
                q = self.queues.get(msg.rid)
                if q is not None:
                    q.put_nowait(msg)
            elif isinstance(msg, P.ControlResp):
                fut = self.controls.pop(msg.cid, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, P.Ready):
                if not self.ready.done():
                    self.ready.set_result(msg)
            else:
                logger.warning("unexpected %s from the scheduler", type(msg).__name__)

    def fail_all(self, reason: str) -> None:
        """The scheduler is gone: wake every waiter with an error."""
        self.dead = reason
        for rid, q in self.queues.items():
            q.put_nowait(P.ReqError(rid=rid, message=reason, status=503))
        for fut in self.controls.values():
            if not fut.done():
                fut.set_result(P.ControlResp(cid="", status=503, error=reason))
        self.controls.clear()

    async def send(self, msg: Any) -> None:
        if self.dead:
            raise ApiError(503, f"the engine is not running: {self.dead}", type="server_error",
                           code="unavailable")
        await self.push.send(P.encode(msg))

    def open(self, rid: str) -> asyncio.Queue[Any]:
        if rid in self.queues:
            raise bad(f"request id {rid!r} is already in use", "rid")
        q: asyncio.Queue[Any] = asyncio.Queue()
        self.queues[rid] = q
        return q

    def close(self, rid: str) -> None:
        self.queues.pop(rid, None)

    async def control(self, op: str, payload: dict[str, Any] | None = None) -> P.ControlResp:
        cid = uuid.uuid4().hex
        fut: asyncio.Future[P.ControlResp] = asyncio.get_running_loop().create_future()
        self.controls[cid] = fut
        try:
            await self.send(P.ControlReq(cid=cid, op=op, payload=payload or {}))
            return await asyncio.wait_for(fut, CONTROL_TIMEOUT)
        except asyncio.TimeoutError as e:  # not the builtin before Python 3.11
            raise ApiError(503, f"the scheduler did not answer {op}", type="server_error",
                           code="timeout") from e
        finally:
            self.controls.pop(cid, None)


# ---------------------------------------------------------------------------------------------
# one generation: token ids in, text increments out
# ---------------------------------------------------------------------------------------------


@dataclass
class Update:
    delta: str  # new text since the previous update (stop strings and partial characters held)
    text: str  # all text so far
    output_ids: list[int]
    finished: bool
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def meta_info(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
        }


@dataclass
class Generation:
    state: ServerState
    rid: str
    input_ids: list[int]
    params: dict[str, Any]
    extra_key: str | None = None
    queue: asyncio.Queue[Any] | None = None
    output_ids: list[int] = field(default_factory=list)
    sent_chars: int = 0
    finished: bool = False
    t0: float = field(default_factory=time.monotonic)
    t_last: float | None = None
    first: Any = None
    stable: str = ""  # text of output_ids[:read_offset]
    prefix_offset: int = 0
    read_offset: int = 0

    async def start(self) -> None:
        """Send the request and wait for its first answer, so that the scheduler's refusal
        becomes a 400 before any streaming response begins."""
        client = self.state.client
        self.queue = client.open(self.rid)
        try:
            await client.send(
                P.GenerateReq(rid=self.rid, input_ids=self.input_ids,
                              sampling_params=self.params, extra_key=self.extra_key)
            )
            self.first = await self.queue.get()
        except BaseException:
            await self.abort()
            raise
        if isinstance(self.first, P.ReqError):
            client.close(self.rid)
            self.finished = True
            status = self.first.status
            raise ApiError(status, self.first.message,
                           type="invalid_request_error" if status < 500 else "server_error",
                           code="invalid_value" if status < 500 else "unavailable")

    async def abort(self) -> None:
        client = self.state.client
        client.close(self.rid)
        if not self.finished and not client.dead:
            self.finished = True
            with contextlib.suppress(ApiError):
                await client.send(P.AbortReq(rid=self.rid))
            if self.state.metrics is not None:
                self.state.metrics.aborted.inc()

    def _decode_incremental(self, skip: bool) -> str:
        """The text of the output so far, decoding only a short window of new tokens per update
        (not the whole output each time). The window starts a few tokens back so the decoder sees
        the context it needs (leading spaces); text is taken only when it does not end in an
        unfinished UTF-8 sequence."""
        tok = self.state.tokenizer
        ids = self.output_ids
        before = tok.decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        after = tok.decode(ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.stable += after[len(before) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return self.stable

    def _text(self, out: P.ReqOut) -> tuple[str, int]:
        """The full text and how much of it may be shown now."""
        stop: list[str] = self.params.get("stop") or []
        skip = bool(self.params.get("skip_special_tokens", True))
        if out.finished:  # one full decode: the final text is exactly the engine's
            text = self.state.tokenizer.decode(self.output_ids, skip_special_tokens=skip)
            reason = out.finish_reason or {}
            if reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
                for s in stop:
                    idx = text.find(s)
                    if idx >= 0:
                        text = text[:idx]
                        break
            return text, len(text)
        text = self._decode_incremental(skip)
        safe = len(text)
        hold = 0
        for s in stop:  # hold back a tail that may become a stop string
            for k in range(min(len(s) - 1, safe), 0, -1):
                if text[safe - k : safe] == s[:k]:
                    hold = max(hold, k)
                    break
        safe -= hold
        return text, max(safe, self.sent_chars)

    def _update(self, out: P.ReqOut) -> Update:
        now = time.monotonic()
        m = self.state.metrics
        n_new = len(out.new_token_ids)
        if m is not None and n_new:
            if self.t_last is None:
                m.ttft.observe(now - self.t0)
                for _ in range(n_new - 1):
                    m.itl.observe(0.0)
            else:
                gap = (now - self.t_last) / n_new
                for _ in range(n_new):
                    m.itl.observe(gap)
        if n_new:
            self.t_last = now
        self.output_ids.extend(out.new_token_ids)
        text, shown = self._text(out)
        delta = text[self.sent_chars : shown]
        self.sent_chars = max(self.sent_chars, shown)
        if out.finished:
            self.finished = True
            self.state.client.close(self.rid)
            if m is not None:
                m.finished(out.prompt_tokens, out.completion_tokens, out.cached_tokens, now - self.t0)
        return Update(
            delta=delta, text=text[: self.sent_chars] if not out.finished else text,
            output_ids=list(self.output_ids), finished=out.finished,
            finish_reason=out.finish_reason, prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens, cached_tokens=out.cached_tokens,
        )

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
            if not self.finished:
                await self.abort()

    async def result(self) -> Update:
        last: Update | None = None
        async for u in self.updates():
            last = u
        assert last is not None
        return last


async def start_all(gens: list[Generation]) -> None:
    """Send every request of a batch before waiting for any, so they are batched together; on
    any refusal abort the others and raise it."""
    got = await asyncio.gather(*(g.start() for g in gens), return_exceptions=True)
    errors = [e for e in got if isinstance(e, BaseException)]
    if errors:
        for g in gens:
            await g.abort()
        raise errors[0]


async def results_or_abort(request: Request, gens: list[Generation]) -> list[Update]:
    """The final updates of `gens`; when the client goes away first, abort them (their KV
    pages are freed at once instead of when the answer nobody reads is complete)."""
    task = asyncio.ensure_future(asyncio.gather(*(g.result() for g in gens)))
    while True:
        done, _ = await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
        if done:
            return list(task.result())
        if await request.is_disconnected():
            task.cancel()
            for g in gens:
                await g.abort()
            raise ApiError(499, "the client closed the connection", code="client_closed")


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


def usage(u: Update) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------
# server state and the app
# ---------------------------------------------------------------------------------------------


@dataclass
class ServerState:
    args: EngineArgs
    tokenizer: Tokenizer
    client: SchedulerClient
    info: P.Ready
    model_name: str
    metrics: ServerMetrics | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    # ---- validation shared by the endpoints ------------------------------------------------

    def check_prompt(self, ids: list[int], param: str = "prompt") -> None:
        info = self.info
        if not ids:
            raise bad("the prompt is empty", param)
        if len(ids) >= info.context_length:
            raise bad(
                f"the prompt has {len(ids)} tokens; this model's context length is "
                f"{info.context_length}", param, code="context_length_exceeded",
            )
        if len(ids) + 1 > info.max_total_tokens:
            raise bad(
                f"the prompt has {len(ids)} tokens; the KV pool holds {info.max_total_tokens}",
                param, code="context_length_exceeded",
            )
        bad_ids = [t for t in ids if not 0 <= t < info.vocab_size]
        if bad_ids:
            raise bad(f"token ids out of the vocabulary (size {info.vocab_size}): {bad_ids[:5]}",
                      param)

    def sampling(
        self, *, max_tokens: int | None, param: str, prompt_len: int, temperature: float | None,
        top_p: float | None, top_k: int | None, stop: str | list[str] | None,
        stop_token_ids: list[int] | None, seed: int | None, ignore_eos: bool | None,
        skip_special_tokens: bool | None,
    ) -> dict[str, Any]:
        ctx = self.info.context_length
        if max_tokens is None:
            max_tokens = ctx - prompt_len
        if max_tokens < 0:
            raise bad(f"{param} must be >= 0, got {max_tokens}", param)
        if max_tokens > ctx:
            raise bad(f"{param} is {max_tokens}; the context length is {ctx}", param)
        sp: dict[str, Any] = {"max_new_tokens": max_tokens}
        if temperature is not None:
            sp["temperature"] = temperature
        if top_p is not None:
            sp["top_p"] = top_p
        if top_k is not None:
            sp["top_k"] = top_k
        if stop is not None:
            sp["stop"] = [stop] if isinstance(stop, str) else list(stop)
        if stop_token_ids is not None:
            sp["stop_token_ids"] = list(stop_token_ids)
        if seed is not None:
            sp["seed"] = seed
        if ignore_eos is not None:
            sp["ignore_eos"] = ignore_eos
        if skip_special_tokens is not None:
            sp["skip_special_tokens"] = skip_special_tokens
        try:
            params = SamplingParams(**sp)
        except (ConfigError, TypeError, ValueError) as e:
            raise bad(str(e), "sampling_params") from e
        sp["stop"] = params.stop
        return sp

    def generation(self, ids: list[int], params: dict[str, Any], extra_key: str | None = None,
                   rid: str | None = None) -> Generation:
        return Generation(self, rid or uuid.uuid4().hex, ids, params, extra_key)

    def tokenize(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_prompt(ids, param)
        return ids


def _openai_params(state: ServerState, body: _OpenAISampling, prompt_len: int,
                   max_tokens: int | None) -> dict[str, Any]:
    if body.n != 1:
        raise bad("only n=1 is supported", "n")
    if body.logprobs:
        raise bad("logprobs are not supported", "logprobs")
    return state.sampling(
        max_tokens=max_tokens, param="max_tokens", prompt_len=prompt_len,
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, stop=body.stop,
        stop_token_ids=body.stop_token_ids, seed=body.seed, ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
    )


def _chat_text(msg: ChatMessage, i: int) -> str:
    if msg.content is None:
        return ""
    if isinstance(msg.content, str):
        return msg.content
    parts = []
    for part in msg.content:
        if part.type != "text" or part.text is None:
            raise bad(f"only text content parts are supported (got {part.type!r})",
                      f"messages.{i}.content")
        parts.append(part.text)
    return "".join(parts)


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` on every path but /health (plain ASGI, so that a request
    still sees its client disconnect)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") != "/health":
            header = b""
            for name, value in scope.get("headers", []):
                if name.lower() == b"authorization":
                    header = value
            given = header[7:] if header[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(given, self.key):
                response = ApiError(
                    401, "invalid or missing API key (Authorization: Bearer KEY)",
                    type="authentication_error", code="invalid_api_key",
                ).response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="hicache-engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    key = state.args.api_key

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        if state.metrics is not None and exc.status < 500:
            state.metrics.bad_requests.inc()
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return ApiError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        return ApiError(500, f"internal error: {exc}", type="server_error",
                        code="internal_error").response()

    if key:
        app.add_middleware(ApiKeyMiddleware, key=key)

    # ---- OpenAI ------------------------------------------------------------------------------

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{
                "id": state.model_name, "object": "model", "created": state.created,
                "owned_by": "hicache", "root": state.info.model_path,
                "max_model_len": state.info.context_length,
            }],
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionBody = await parse_body(request, CompletionBody)
        prompts: list[str | list[int]]
        p = body.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            prompts = [p]
        else:
            prompts = list(p)  # type: ignore[arg-type]
        if not prompts:
            raise bad("the prompt is empty", "prompt")
        if body.stream and len(prompts) > 1:
            raise bad("streaming takes one prompt", "prompt")
        gens = []
        for i, pr in enumerate(prompts):
            ids = state.tokenize(pr, "prompt" if len(prompts) == 1 else f"prompt.{i}")
            gens.append(state.generation(ids, _openai_params(state, body, len(ids),
                                                             body.max_tokens),
                                         body.cache_salt))
        cid = f"cmpl-{gens[0].rid}"
        created = int(time.time())
        if body.stream:
            gen = gens[0]
            await gen.start()
            echo = state.tokenizer.decode(gen.input_ids) if body.echo else ""
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def stream() -> AsyncIterator[bytes]:
                first = True
                try:
                    async for u in gen.updates():
                        text = (echo if first else "") + u.delta
                        first = False
                        if text or u.finished:
                            yield sse({
                                "id": cid, "object": "text_completion", "created": created,
                                "model": state.model_name,
                                "choices": [{"index": 0, "text": text, "logprobs": None,
                                             "finish_reason": finish_reason_str(u.finish_reason)
                                             if u.finished else None}],
                            })
                        if u.finished and include_usage:
                            yield sse({"id": cid, "object": "text_completion",
                                       "created": created, "model": state.model_name,
                                       "choices": [], "usage": usage(u)})
                except ApiError as e:
                    yield sse(e.body())
                yield SSE_DONE

            return StreamingResponse(stream(), media_type="text/event-stream")
        await start_all(gens)
        results = await results_or_abort(request, gens)
        for u in results:
            check_aborted(u)
        choices = []
        for i, (g, u) in enumerate(zip(gens, results)):
            echo = state.tokenizer.decode(g.input_ids) if body.echo else ""
            choices.append({"index": i, "text": echo + u.text, "logprobs": None,
                            "finish_reason": finish_reason_str(u.finish_reason)})
        total = {
            "prompt_tokens": sum(u.prompt_tokens for u in results),
            "completion_tokens": sum(u.completion_tokens for u in results),
            "total_tokens": sum(u.prompt_tokens + u.completion_tokens for u in results),
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in results)},
        }
        return JSONResponse({"id": cid, "object": "text_completion", "created": created,
                             "model": state.model_name, "choices": choices, "usage": total})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body: ChatBody = await parse_body(request, ChatBody)
        if not body.messages:
            raise bad("messages must not be empty", "messages")
        msgs = [{"role": m.role, "content": _chat_text(m, i)} for i, m in
                enumerate(body.messages)]
        try:
            ids = state.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        except ConfigError as e:
            raise bad(str(e), "messages") from e
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise bad(f"the chat template failed on these messages: {e}", "messages") from e
        assert isinstance(ids, list)
        state.check_prompt(ids, "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
            else body.max_tokens
        gen = state.generation(ids, _openai_params(state, body, len(ids), max_tokens),
                               body.cache_salt)
        cid = f"chatcmpl-{gen.rid}"
        created = int(time.time())
        await gen.start()
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
                return sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                            "model": state.model_name,
                            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish}]})

            async def stream() -> AsyncIterator[bytes]:
                yield chunk({"role": "assistant", "content": ""}, None)
                try:
                    async for u in gen.updates():
                        if u.delta:
                            yield chunk({"content": u.delta}, None)
                        if u.finished:
                            yield chunk({}, finish_reason_str(u.finish_reason))
                            if include_usage:
                                yield sse({"id": cid, "object": "chat.completion.chunk",
                                           "created": created, "model": state.model_name,
                                           "choices": [], "usage": usage(u)})
                except ApiError as e:
                    yield sse(e.body())
                yield SSE_DONE

            return StreamingResponse(stream(), media_type="text/event-stream")
        (u,) = await results_or_abort(request, [gen])
        check_aborted(u)
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": created,
            "model": state.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": u.text},
                         "logprobs": None, "finish_reason": finish_reason_str(u.finish_reason)}],
            "usage": usage(u),
        })

    # ---- SGLang native ---------------------------------------------------------------------

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body: GenerateBody = await parse_body(request, GenerateBody)
        if (body.text is None) == (body.input_ids is None):
            raise bad("give exactly one of text and input_ids", "text")
        batch: list[str | list[int]]
        single = isinstance(body.text, str) or (
            body.input_ids is not None and (not body.input_ids or
                                            isinstance(body.input_ids[0], int))
        )
        if single:
            batch = [body.text if body.text is not None else body.input_ids]  # type: ignore[list-item]
        else:
            batch = list(body.text if body.text is not None else body.input_ids)  # type: ignore[arg-type]
        if not batch:
            raise bad("the batch is empty", "text")
        if body.stream and len(batch) > 1:
            raise bad("streaming takes one prompt", "text")
        sp = body.sampling_params or GenerateSampling()
        gens = []
        for i, pr in enumerate(batch):
            param = ("text" if body.text is not None else "input_ids") + (
                "" if single else f".{i}")
            ids = state.tokenize(pr, param)
            params = state.sampling(
                max_tokens=128 if sp.max_new_tokens is None else sp.max_new_tokens,
                param="sampling_params.max_new_tokens", prompt_len=len(ids),
                temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, stop=sp.stop,
                stop_token_ids=sp.stop_token_ids, seed=sp.seed, ignore_eos=sp.ignore_eos,
                skip_special_tokens=sp.skip_special_tokens,
            )
            rid = body.rid if single and body.rid else None
            gens.append(state.generation(ids, params, body.extra_key, rid))

        def shape(g: Generation, u: Update) -> dict[str, Any]:
            meta = {"id": g.rid, **u.meta_info}
            return {"text": u.text, "output_ids": u.output_ids, "meta_info": meta}

        if body.stream:
            gen = gens[0]
            await gen.start()

            async def stream() -> AsyncIterator[bytes]:
                try:
                    async for u in gen.updates():
                        yield sse(shape(gen, u))
                except ApiError as e:
                    yield sse(e.body())
                yield SSE_DONE

            return StreamingResponse(stream(), media_type="text/event-stream")
        await start_all(gens)
        results = await results_or_abort(request, gens)
        out = [shape(g, u) for g, u in zip(gens, results)]
        return JSONResponse(out[0] if single else out)

    # ---- operations ------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        if state.client.dead:
            return ApiError(503, f"the engine is not running: {state.client.dead}",
                            type="server_error", code="unavailable").response()
        return JSONResponse({"status": "ok"})

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        i = state.info
        return {"model_path": i.model_path, "model_id": i.model_id,
                "tokenizer_path": str(state.tokenizer.path), "is_generation": True,
                "context_length": i.context_length, "page_size": i.page_size,
                "max_total_tokens": i.max_total_tokens, "scheduler_pid": i.pid}

    async def _control(op: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        resp = await state.client.control(op, payload)
        if resp.status != 200:
            code = {409: "busy", 503: "unavailable"}.get(resp.status, "invalid_value")
            raise ApiError(resp.status, resp.error or op, code=code,
                           type="server_error" if resp.status >= 500 else
                           "invalid_request_error")
        return dict(resp.payload)

    @app.api_route("/flush_cache", methods=["POST", "GET"])
    async def flush_cache() -> dict[str, Any]:
        return await _control("flush_cache")

    @app.get("/hicache/stats")
    async def hicache_stats() -> dict[str, Any]:
        return await _control("stats")

    @app.get("/hicache/storage-backend")
    async def get_storage() -> dict[str, Any]:
        return await _control("get_storage")

    @app.put("/hicache/storage-backend")
    async def put_storage(request: Request) -> dict[str, Any]:
        body: StorageBody = await parse_body(request, StorageBody)
        return await _control("attach_storage",
                              {"backend": body.backend, "extra_config": body.extra_config or {}})

    @app.delete("/hicache/storage-backend")
    async def delete_storage() -> dict[str, Any]:
        return await _control("detach_storage")

    @app.post("/hicache/storage-backend/clear")
    async def clear_storage() -> dict[str, Any]:
        return await _control("clear_storage")

    if state.metrics is not None:
        metrics = state.metrics

        @app.get("/metrics")
        async def prometheus() -> Response:
            metrics.update(await _control("stats", {"bandwidth": True}))
            return Response(metrics.render(),
                            media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
