"""OpenAI-compatible routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

`n` > 1 computes each prompt once (`prefill_prompts`), then samples n choices that share its
pages; choices are numbered prompt-major (`index = prompt * n + sample`), streamed chunks carry
their choice's `index`, and usage counts each prompt once and every choice's completion. With
`stream_options: {"include_usage": true, "continuous_usage_stats": true}` every chunk also carries
the usage so far of its choice (vLLM's; guidellm asks for it), and the last the total.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.server import logprob_format as LF
from engine.server import openai_params as OP
from engine.server.generation import (
    Generation,
    Update,
    check_aborted,
    finish_reason_str,
    merged,
    prefill_prompts,
    results_or_abort,
    sse_response,
    start_all,
    usage,
)
from engine.server.schemas import (
    ApiError,
    ChatBody,
    ChatMessage,
    CompletionBody,
    bad,
    cache_hints,
    cache_key,
)
from engine.server.state import ServerState

# (token ids, sampling params, param name) of each prompt of a request.
Prepared = list[tuple[list[int], dict[str, Any]]]


def _params(state: ServerState, body: CompletionBody | ChatBody, prompt_len: int,
            max_tokens: int | None) -> dict[str, Any]:
    extra = OP.openai_sampling(body)
    if body.bad_words:
        extra["bad_words_ids"] = state.words_ids(body.bad_words)
    return state.sampling(
        max_tokens=max_tokens, param="max_tokens", prompt_len=prompt_len,
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, stop=body.stop,
        stop_token_ids=body.stop_token_ids, seed=body.seed, ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens, extra=extra,
    )


def _one(value: str | list[str] | None, param: str) -> str | None:
    """SGLang's list form of a field of one request: a one-element list is its value."""
    if not isinstance(value, list):
        return value
    if len(value) != 1:
        raise bad(f"{param}: a list names one request per prompt; this route answers one "
                  f"request, so give one, got {len(value)}", param)
    return value[0]


def _response_id(body: CompletionBody | ChatBody, prefix: str, gens: list[Generation]) -> str:
    """SGLang's `rid` as it is, vLLM's `request_id` after the prefix, else the engine's id."""
    rid = _one(body.rid, "rid")
    if rid is not None:
        return rid
    return f"{prefix}-{body.request_id if body.request_id is not None else gens[0].rid}"


def _cache_key(body: CompletionBody | ChatBody) -> str | None:
    return cache_key(_one(body.extra_key, "extra_key"), body.cache_salt)


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


def _check_details(body: CompletionBody | ChatBody) -> None:
    """`return_cached_tokens_details` with n > 1 is refused: the samples share a prefill made
    first, so their own outcomes would say device hits for what the prefill computed."""
    if body.return_cached_tokens_details and body.n > 1:
        raise bad("return_cached_tokens_details needs n == 1", "return_cached_tokens_details")


def _prepare_completion(state: ServerState, body: CompletionBody) -> tuple[Prepared, list[str]]:
    """Each prompt's ids and params, and the text echoed in front of its choices."""
    p = body.prompt
    prompts: list[Any] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if not prompts:
        raise bad("the prompt is empty", "prompt")
    state.check_n(body.n, len(prompts))
    _check_details(body)
    out = []
    for i, pr in enumerate(prompts):
        ids = state.tokenize(pr, "prompt" if len(prompts) == 1 else f"prompt.{i}",
                             add_special_tokens=body.add_special_tokens,
                             truncate=body.truncate_prompt_tokens)
        out.append((ids, _params(state, body, len(ids), body.max_tokens)))
    return out, [state.decode(ids) if body.echo else "" for ids, _ in out]


def _chat_prompt(state: ServerState, body: ChatBody) -> list[int]:
    """The prompt's ids: the chat template over the messages; with `continue_final_message`
    and a last message from the assistant, the template over the others (with its generation
    prompt) followed by that message's text, as SGLang builds it (with
    `add_generation_prompt: false`, vLLM's way: the template over all, the last message left
    open); or `input_ids` as given."""
    trunc = body.truncate_prompt_tokens
    if body.input_ids is not None:
        return state.tokenize(body.input_ids, "input_ids", truncate=trunc)
    msgs: list[dict[str, str]] = []
    for i, m in enumerate(body.messages):
        msgs.append({"role": m.role, "content": _chat_text(m, i)})
        if m.name is not None:
            msgs[-1]["name"] = m.name
    opts: dict[str, Any] = {"template_kwargs": body.chat_template_kwargs,
                            "add_special_tokens": body.add_special_tokens}
    if not body.add_generation_prompt:
        return state.chat_ids(msgs, add_generation_prompt=False, truncate=trunc,
                              continue_final_message=body.continue_final_message, **opts)
    prefix = None
    if body.continue_final_message and msgs[-1]["role"] == "assistant":
        prefix = msgs.pop()["content"]
        if not msgs:
            raise bad("continue_final_message needs a message before the assistant's",
                      "continue_final_message")
    ids = state.chat_ids(msgs, truncate=None if prefix else trunc, **opts)
    if prefix:
        tok = state.tokenize(prefix, f"messages.{len(msgs)}.content")
        bos = getattr(state.tokenizer.hf, "bos_token_id", None)
        ids = state.truncate(ids + (tok[1:] if tok[0] == bos else tok), trunc)
        state.check_prompt(ids, "messages")
    return ids


def _chat_echo(body: ChatBody) -> tuple[str, str]:
    """(the answer's role, the text echoed in front of it): the role is the assistant's, or
    without the generation prompt the last message's; with `echo`, a last message of that role
    comes first (vLLM's)."""
    last = body.messages[-1] if body.messages else None
    role = "assistant" if body.add_generation_prompt or last is None else last.role
    if not body.echo or last is None or last.role != role:
        return role, ""
    return role, _chat_text(last, len(body.messages) - 1)


def _prepare_chat(state: ServerState, body: ChatBody) -> Prepared:
    if not body.messages:
        raise bad("messages must not be empty", "messages")
    state.check_n(body.n, 1)
    _check_details(body)
    ids = _chat_prompt(state, body)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    return [(ids, _params(state, body, len(ids), max_tokens))]


async def _launch(state: ServerState, prepared: Prepared, n: int, salt: str | None,
                  logprobs: OP.LogprobSpec | None = None,
                  hints: dict[str, Any] | None = None) -> tuple[list[Generation], list[int]]:
    """Start n generations per prompt (after computing each prompt once when n > 1). Returns
    them and, per prompt, the tokens that were cached before this request."""
    cached: list[int] | None = None
    if n > 1:
        cached = await prefill_prompts(state, [(ids, salt) for ids, _ in prepared], hints)
    gens: list[Generation] = []
    for i, (ids, params) in enumerate(prepared):
        gens += state.samples(ids, params, salt, n, i * n)
    for g in gens:
        g.logprobs = logprobs
        g.cache_hints = hints
    await start_all(gens)
    return gens, cached if cached is not None else [-1] * len(prepared)


def _usage(prepared: Prepared, n: int, finals: list[Update], cached: list[int],
           details: bool = False) -> dict[str, Any]:
    """Each prompt counted once; cached tokens: the hits before this request (n > 1), else what
    the scheduler reported. With `details` (`return_cached_tokens_details`, n == 1), also every
    prompt token's outcome: `prompt_tokens_details.cache_outcomes`, a hit tier or a miss cause
    (hicache.attribution) -> tokens, summed over the prompts."""
    prompt = sum(len(ids) for ids, _ in prepared)
    completion = sum(u.completion_tokens for u in finals)
    hits = sum(c if c >= 0 else finals[i * n].cached_tokens for i, c in enumerate(cached))
    out = usage(prompt, completion, hits)
    if details:
        outcomes: dict[str, int] = {}
        for u in finals:
            for cause, tokens in (u.cache_outcomes or {}).items():
                outcomes[cause] = outcomes.get(cause, 0) + int(tokens)
        out["prompt_tokens_details"]["cache_outcomes"] = outcomes
    return out


def _usage_chunk(head: dict[str, Any], prepared: Prepared, n: int, finals: dict[int, Update],
                 cached: list[int], details: bool = False) -> dict[str, Any]:
    """The last chunk of a stream that asked for usage (`stream_options.include_usage`)."""
    done = [finals[i] for i in sorted(finals)]
    return {**head, "choices": [], "usage": _usage(prepared, n, done, cached, details)}



async def _completed(request: Request, gens: list[Generation]) -> list[Update]:
    """The final updates of a non-streamed answer; an aborted one is a 400."""
    results = await results_or_abort(request, gens)
    for u in results:
        check_aborted(u)
    return results


def _new_lp(u: Update) -> bool:
    """Whether `u` brings output logprobs (or is the first with the prompt's)."""
    return u.logprobs is not None and (u.lp_first < len(u.logprobs.output)
                                       or u.logprobs.prompt_start >= 0 and u.lp_first == 0)


def _running_usage(prepared: Prepared, n: int, u: Update) -> dict[str, Any]:
    """The usage so far of `u`'s choice (a chunk's, with continuous_usage_stats)."""
    prompt = len(prepared[u.index // n][0])
    return {"prompt_tokens": prompt, "completion_tokens": u.completion_tokens,
            "total_tokens": prompt + u.completion_tokens}


def _stream_usage(body: CompletionBody | ChatBody) -> tuple[bool, bool]:
    """(a last usage chunk, usage in every chunk) asked by `stream_options`."""
    so = body.stream_options
    last = bool(so and so.include_usage)
    return last, last and bool(so and so.continuous_usage_stats)


def register(app: FastAPI, state: ServerState) -> None:
    name = state.model_name
    plain_text = LF.make_token_text(state.tokenizer, state._tok_lock)

    def id_text(tok: int) -> str:
        return f"token_id:{tok}"

    def token_text(body: CompletionBody | ChatBody) -> LF.TokenText:
        return id_text if body.return_tokens_as_token_ids else plain_text

    def prompt_lp(body: CompletionBody | ChatBody, prepared: Prepared, n: int,
                  u: Update) -> dict[str, Any]:
        """vLLM's `prompt_logprobs` of `u`'s prompt, as a choice's field (none unless asked)."""
        if body.prompt_logprobs is None or u.logprobs is None:
            return {}
        return {"prompt_logprobs": LF.prompt_logprobs(u.logprobs, token_text(body),
                                                      prepared[u.index // n][0],
                                                      body.prompt_logprobs)}

    def model_card() -> dict[str, Any]:
        return {"id": name, "object": "model", "created": state.created, "owned_by": "hicache",
                "root": state.info.model_path, "parent": None,
                "max_model_len": state.info.context_length}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != name:
            raise ApiError(404, f"the model {model_id!r} does not exist; this server serves "
                           f"{name!r}", param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body, got = await state.parse(
            request, CompletionBody, lambda b: _prepare_completion(state, b))
        assert got is not None
        prepared, echoes = got
        n = body.n
        gens, cached = await _launch(state, prepared, n, _cache_key(body),
                                     OP.completion_logprobs(body), cache_hints(body))
        cid, created = _response_id(body, "cmpl", gens), int(time.time())
        tok_text = token_text(body)

        def logprobs(u: Update, first: int = 0, offset: int = 0,
                     echo: bool = False) -> dict[str, Any] | None:
            if u.logprobs is None or body.logprobs is None:
                return None
            ids = prepared[u.index // n][0] if echo else None
            return LF.completion_logprobs(u.logprobs, tok_text, first, ids, offset=offset,
                                          k=body.logprobs)

        head = {"id": cid, "object": "text_completion", "created": created, "model": name}
        if body.stream:
            include_usage, every_chunk = _stream_usage(body)

            async def events() -> AsyncIterator[dict[str, Any]]:
                started: set[int] = set()
                finals: dict[int, Update] = {}
                offsets: dict[int, int] = {}  # text offset of each choice's next token
                async for u in merged(gens):
                    text = u.delta
                    first = u.index not in started
                    if first:
                        started.add(u.index)
                        text = echoes[u.index // n] + text
                    if text or u.finished or _new_lp(u):
                        reason = finish_reason_str(u.finish_reason) if u.finished else None
                        lp = logprobs(u, u.lp_first, offsets.get(u.index, 0),
                                      first and body.echo)
                        if lp is not None and lp["tokens"]:
                            offsets[u.index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                        choice = {"index": u.index, "text": text, "logprobs": lp,
                                  "finish_reason": reason,
                                  **(prompt_lp(body, prepared, n, u) if first else {})}
                        event: dict[str, Any] = {**head, "choices": [choice]}
                        if every_chunk:
                            event["usage"] = _running_usage(prepared, n, u)
                        yield event
                    if u.finished:
                        finals[u.index] = u
                if include_usage:
                    yield _usage_chunk(head, prepared, n, finals, cached,
                                       body.return_cached_tokens_details)

            return sse_response(events())
        results = await _completed(request, gens)
        choices = [{"index": u.index, "text": echoes[u.index // n] + u.text,
                    "logprobs": logprobs(u, echo=body.echo),
                    "finish_reason": finish_reason_str(u.finish_reason),
                    **prompt_lp(body, prepared, n, u)} for u in results]
        return JSONResponse({**head, "choices": choices,
                             "usage": _usage(prepared, n, results, cached,
                                             body.return_cached_tokens_details)})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body, prepared = await state.parse(request, ChatBody, lambda b: _prepare_chat(state, b))
        assert prepared is not None
        n = body.n
        gens, cached = await _launch(state, prepared, n, _cache_key(body),
                                     OP.chat_logprobs(body), cache_hints(body))
        cid, created = _response_id(body, "chatcmpl", gens), int(time.time())
        tok_text = token_text(body)
        role, echo = _chat_echo(body)

        def logprobs(u: Update, first: int = 0) -> dict[str, Any] | None:
            if u.logprobs is None or not body.logprobs:
                return None
            return LF.chat_logprobs(u.logprobs, tok_text, first, k=body.top_logprobs or 0)

        head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": name}
        if body.stream:
            include_usage, every_chunk = _stream_usage(body)

            def chunk(index: int, delta: dict[str, Any], finish: str | None,
                      lp: dict[str, Any] | None = None, u: Update | None = None,
                      **extra: Any) -> dict[str, Any]:
                out = {**head, "choices": [{"index": index, "delta": delta, "logprobs": lp,
                                            "finish_reason": finish, **extra}]}
                if every_chunk:
                    out["usage"] = _running_usage(prepared, n, u) if u is not None else {
                        "prompt_tokens": len(prepared[index // n][0]), "completion_tokens": 0,
                        "total_tokens": len(prepared[index // n][0])}
                return out

            async def events() -> AsyncIterator[dict[str, Any]]:
                for g in gens:
                    yield chunk(g.index, {"role": role, "content": ""}, None)
                    if echo:
                        yield chunk(g.index, {"content": echo}, None)
                finals: dict[int, Update] = {}
                started: set[int] = set()
                async for u in merged(gens):
                    extra = {} if u.index in started else prompt_lp(body, prepared, n, u)
                    started.add(u.index)
                    if u.delta or _new_lp(u) or extra:
                        yield chunk(u.index, {"content": u.delta}, None,
                                    logprobs(u, u.lp_first), u, **extra)
                    if u.finished:
                        finals[u.index] = u
                        yield chunk(u.index, {}, finish_reason_str(u.finish_reason), u=u)
                if include_usage:
                    yield _usage_chunk(head, prepared, n, finals, cached,
                                       body.return_cached_tokens_details)

            return sse_response(events())
        results = await _completed(request, gens)
        choices = [{"index": u.index, "message": {"role": role, "content": echo + u.text},
                    "logprobs": logprobs(u), "finish_reason": finish_reason_str(u.finish_reason),
                    **prompt_lp(body, prepared, n, u)}
                   for u in results]
        return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                             "usage": _usage(prepared, n, results, cached,
                                             body.return_cached_tokens_details)})
