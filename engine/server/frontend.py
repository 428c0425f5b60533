"""The HTTP front end: a FastAPI app with the tokenizer in this process.

Prompts are tokenized here (on worker threads) and sent to the scheduler process as token ids;
the scheduler streams back token ids and their text (it owns detokenization and stop strings),
and the routes speak OpenAI's and SGLang's HTTP shapes. Every bad request is a 4xx with an
OpenAI-style body `{"error": {"message", "type", "param", "code"}}`.

| module | holds |
|---|---|
| `schemas.py` | request bodies, strict decoding, unsupported fields, `ApiError` |
| `client.py` | `SchedulerClient`: the ZeroMQ connection to the scheduler process |
| `generation.py` | `Generation` and `Update`, batches, parallel sampling, the SSE helper |
| `state.py` | `ServerState`: bounded body reading, tokenization off the event loop, limits |
| `openai_api.py` | `/v1/models`, `/v1/completions`, `/v1/chat/completions` |
| `native_api.py` | `/generate`, `/health`, info, `/flush_cache`, `/hicache/*`, `/metrics` |
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.server import native_api, openai_api
from engine.server.client import SchedulerClient
from engine.server.schemas import ApiError
from engine.server.state import ServerState

__all__ = ["ApiError", "SchedulerClient", "ServerState", "create_app"]

logger = logging.getLogger(__name__)


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


# Refused fields a log line names at most (a body may hold thousands of unknown ones).
LOG_FIELDS = 20


def _named(fields: Iterable[str]) -> str:
    """The fields of a refusal for one log line: escaped (a client's key may hold a newline),
    at most LOG_FIELDS of them."""
    names = [ascii(f)[1:-1] for f in fields]
    more = f" and {len(names) - LOG_FIELDS} more" if len(names) > LOG_FIELDS else ""
    return ", ".join(names[:LOG_FIELDS]) + more


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="hicache-engine", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        if exc.status < 500:
            # The route, the code and the fields; never the message (it may quote the prompt).
            logger.info("refused %s %s: %d %s (%s)", request.method, request.url.path,
                        exc.status, exc.code, _named(exc.fields) or exc.param or "-")
            if state.metrics is not None:
                state.metrics.bad_requests.inc()
                state.metrics.refused(exc.fields)
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

    if state.args.api_key:
        app.add_middleware(ApiKeyMiddleware, key=state.args.api_key)
    openai_api.register(app, state)
    native_api.register(app, state)
    return app
