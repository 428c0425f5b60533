"""SGLang's native routes and the operations endpoints: `/generate`, `/health`,
`/get_model_info`, `/get_server_info`, `/flush_cache`, `/hicache/*`, `/metrics`."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from engine.server import logprob_format as LF
from engine.server import openai_params as OP
from engine.server.generation import (
    Generation,
    Update,
    merged,
    prefill_prompts,
    results_or_abort,
    sse_response,
    start_all,
)
from engine.server.schemas import (
    ApiError,
    GenerateBody,
    GenerateSampling,
    StorageBody,
    bad,
    cache_hints,
    cache_key,
)
from engine.server.state import MAX_BODY_BYTES, ServerState


class LookupBody(BaseModel):
    """`POST /hicache/lookup`: a prompt as text or token ids, and its cache namespace."""

    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    input_ids: list[int] | None = None
    extra_key: str | None = None
    cache_salt: str | None = None

# Keys of the extra config whose values are never shown (as the scheduler's GET does).
_SECRET_WORDS = ("token", "password", "secret", "key", "credential")


def _redact(extra: dict[str, Any]) -> dict[str, Any]:
    return {k: ("***" if any(w in k.lower() for w in _SECRET_WORDS) else v)
            for k, v in extra.items()}


def _prepare_generate(state: ServerState, body: GenerateBody) -> tuple[list[Any], bool]:
    """(ids, params) of each prompt, and whether the request is a single prompt."""
    if (body.text is None) == (body.input_ids is None):
        raise bad("give exactly one of text and input_ids", "text")
    src: Any = body.text if body.text is not None else body.input_ids
    single = isinstance(src, str) or (isinstance(src, list) and (not src or
                                                                  isinstance(src[0], int)))
    batch: list[Any] = [src] if single else list(src)
    if not batch:
        raise bad("the batch is empty", "text")
    sp = body.sampling_params or GenerateSampling()
    state.check_n(sp.n, len(batch), "sampling_params.n")
    out = []
    for i, pr in enumerate(batch):
        param = ("text" if body.text is not None else "input_ids") + ("" if single else f".{i}")
        ids = state.tokenize(pr, param)
        params = state.sampling(
            max_tokens=128 if sp.max_new_tokens is None else sp.max_new_tokens,
            param="sampling_params.max_new_tokens", prompt_len=len(ids),
            temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, stop=sp.stop,
            stop_token_ids=sp.stop_token_ids, seed=OP.generate_seed(sp), ignore_eos=sp.ignore_eos,
            skip_special_tokens=sp.skip_special_tokens, extra=OP.generate_sampling(sp),
        )
        out.append((ids, params))
    return out, single


def _per_prompt(value: str | list[str] | None, n_prompts: int, param: str) -> list[str | None]:
    """SGLang's `rid` / `extra_key`: one value for every prompt, or a list of one per prompt."""
    if not isinstance(value, list):
        return [value] * n_prompts
    if len(value) != n_prompts:
        raise bad(f"{param} lists {len(value)} values for {n_prompts} prompt(s): give one per "
                  "prompt", param)
    return list(value)


def register(app: FastAPI, state: ServerState) -> None:
    tok_text = LF.make_token_text(state.tokenizer, state._tok_lock)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body, got = await state.parse(request, GenerateBody,
                                      lambda b: _prepare_generate(state, b))
        assert got is not None
        prepared, single = got
        n = (body.sampling_params or GenerateSampling()).n
        keys = [cache_key(k, body.cache_salt)
                for k in _per_prompt(body.extra_key, len(prepared), "extra_key")]
        rids = _per_prompt(body.rid, len(prepared), "rid")
        cached: list[int] | None = None
        hints = cache_hints(body)
        if n > 1:
            cached = await prefill_prompts(state, [(ids, keys[i])
                                                   for i, (ids, _) in enumerate(prepared)], hints)
        gens: list[Generation] = []
        for i, (ids, params) in enumerate(prepared):
            gens += state.samples(ids, params, keys[i], n, i * n, client_rid=rids[i])
        lp_spec = OP.generate_logprobs(body)
        for g in gens:
            g.logprobs = lp_spec
            g.cache_hints = hints
        await start_all(gens)
        many = len(gens) > 1

        def shape(u: Update) -> dict[str, Any]:
            meta: dict[str, Any] = u.meta_info
            if cached is not None:  # the prompt's hits before this request
                meta["cached_tokens"] = cached[u.index // n]
            if u.logprobs is not None:
                meta.update(LF.sglang_meta(u.logprobs, tok_text if body.return_text_in_logprobs
                                           else None, prepared[u.index // n][0]))
            out: dict[str, Any] = {"text": u.text, "output_ids": u.output_ids, "meta_info": meta}
            if many:
                out["index"] = u.index
            return out

        if body.stream:
            async def events() -> AsyncIterator[dict[str, Any]]:
                async for u in merged(gens):
                    yield shape(u)

            return sse_response(events())
        results = await results_or_abort(request, gens)
        out = [shape(u) for u in results]
        return JSONResponse(out[0] if single and n == 1 else out)

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

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        """The server's settings (SGLang's shape: the arguments at the top level, secrets
        hidden), the model's limits, and the scheduler's state now."""
        args = dataclasses.asdict(state.args)
        if args.get("api_key"):
            args["api_key"] = "***"
        extra = args.get("hicache_storage_backend_extra_config")
        if isinstance(extra, str):
            extra = json.loads(extra)
        if isinstance(extra, dict):
            args["hicache_storage_backend_extra_config"] = _redact(extra)
        stats = await _control("stats")
        i = state.info
        return {
            **args, "version": importlib.metadata.version("hicache"),
            "served_model_name": state.model_name, "model_id": i.model_id,
            "context_length": i.context_length, "max_total_num_tokens": i.max_total_tokens,
            "vocab_size": i.vocab_size, "storage_backend": stats.get("storage_backend"),
            "scheduler_pid": i.pid, "max_request_body_bytes": MAX_BODY_BYTES,
            "internal_states": [{"scheduler": stats.get("scheduler"),
                                 "usage": stats.get("usage")}],
        }

    @app.api_route("/flush_cache", methods=["POST", "GET"])
    async def flush_cache() -> dict[str, Any]:
        return await _control("flush_cache")

    @app.get("/hicache/stats")
    async def hicache_stats() -> dict[str, Any]:
        return await _control("stats")

    @app.post("/hicache/lookup")
    async def hicache_lookup(request: Request) -> dict[str, Any]:
        """How much of a prompt this engine holds now (device, then host), its page size and
        L3 namespace: what `hicache-admin lookup` asks each engine."""
        def tokens(b: LookupBody) -> list[int]:
            if (b.text is None) == (b.input_ids is None):
                raise bad("give exactly one of text and input_ids", "text")
            src = b.text if b.text is not None else b.input_ids
            assert src is not None
            return list(state.tokenize(src, "text"))

        body, ids = await state.parse(request, LookupBody, tokens)
        out = await _control("lookup", {"input_ids": list(ids or []),
                                        "extra_key": cache_key(body.extra_key, body.cache_salt)})
        return {**out, "input_ids": list(ids or [])}

    @app.get("/hicache/storage-backend")
    async def get_storage() -> dict[str, Any]:
        return await _control("get_storage")

    @app.put("/hicache/storage-backend")
    async def put_storage(request: Request) -> dict[str, Any]:
        body, _ = await state.parse(request, StorageBody)
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
