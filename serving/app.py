"""The OpenAI-compatible HTTP app (ASGI, Starlette) around a running engine.

::

    async with Engine(config, executor) as engine:
        app = build_app(engine, tokenizer, model_name="my-model", max_model_len=8192)
        await uvicorn.Server(uvicorn.Config(app, port=8000)).serve()

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streamed as
server-sent events with ``"stream": true``), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus). Every refusal is a 4xx/5xx with an OpenAI error body, and
the server keeps serving. A client that disconnects aborts its request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

import anyio
import attrs
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Send
from tokenizers import Tokenizer

from hybridkv.scheduler import Engine
from hybridkv.serving.chat import ChatTemplate, ChatTemplateError
from hybridkv.serving.metrics import CONTENT_TYPE, ServerMetrics
from hybridkv.serving.protocol import APIError, error_body, parse_chat, parse_completion, parse_json
from hybridkv.serving.service import GenerationService

log = structlog.get_logger(__name__)


@attrs.frozen(kw_only=True)
class ServerOptions:
    """Limits of the HTTP layer.

    Attributes:
        max_body_bytes: Largest request body accepted (413 beyond).
        default_max_tokens: Output limit of a chat request that sets none; None lets it
            run to the end of the context.
    """

    max_body_bytes: int = attrs.field(default=4 * 2**20, validator=attrs.validators.ge(1))
    default_max_tokens: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )


class _ClosingStreamingResponse(StreamingResponse):
    """Closes the body iterator however streaming ends (a disconnect cancels it), so the
    request's ``finally`` runs now rather than whenever the iterator is collected."""

    async def stream_response(self, send: Send) -> None:
        async with aclosing(self.body_iterator):  # type: ignore[type-var]
            await super().stream_response(send)


def build_app(
    engine: Engine,
    tokenizer: Tokenizer,
    *,
    model_name: str,
    max_model_len: int,
    chat_template: ChatTemplate | None = None,
    options: ServerOptions | None = None,
) -> Starlette:
    """The ASGI app serving ``engine`` under the name ``model_name``."""
    options = options or ServerOptions()
    policies = [p.name for p in engine.config.policies]
    metrics = ServerMetrics(engine.stats, policies)
    service = GenerationService(
        engine,
        tokenizer,
        model_name=model_name,
        max_model_len=max_model_len,
        chat_template=chat_template or ChatTemplate.plain(),
        metrics=metrics,
        default_max_tokens=options.default_max_tokens,
    )
    routes = _Routes(service, metrics, options)
    app = Starlette(
        routes=[
            Route(
                "/v1/completions",
                routes.endpoint("completions", parse_completion),
                methods=["POST"],
            ),
            Route("/v1/chat/completions", routes.endpoint("chat", parse_chat), methods=["POST"]),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
        ],
        exception_handlers={HTTPException: _http_error},  # type: ignore[dict-item]
    )
    app.state.service = service
    app.state.metrics = metrics
    return app


class _Routes:
    def __init__(self, service: GenerationService, metrics: ServerMetrics, options: ServerOptions):
        self.service = service
        self.metrics_ = metrics
        self.options = options

    def endpoint(
        self, name: str, parse: Callable[[dict[str, Any]], Any]
    ) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            try:
                response = await self._generate(request, parse)
            except APIError as exc:
                response = JSONResponse(exc.body(), status_code=exc.status)
            except ChatTemplateError as exc:
                response = JSONResponse(APIError(str(exc), param="messages").body(), 400)
            self.metrics_.requests.labels(endpoint=name, status=str(response.status_code)).inc()
            return response

        return handle

    async def _generate(self, request: Request, parse: Callable[[dict[str, Any]], Any]) -> Response:
        body = parse(parse_json(await _read_body(request, self.options.max_body_bytes)))
        job = self.service.submit(body)
        if body.stream:
            return _ClosingStreamingResponse(
                self.service.stream(job),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        outcome: list[dict[str, Any] | APIError] = []

        async def complete() -> None:
            try:
                outcome.append(await self.service.complete(job))
            except APIError as exc:
                outcome.append(exc)
            tg.cancel_scope.cancel()

        # Run until done or until the client disconnects (then the request is aborted).
        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_on_disconnect, request, tg.cancel_scope)
            tg.start_soon(complete)
        if not outcome:
            return Response(status_code=499)  # nobody reads it: the client has gone
        if isinstance(outcome[0], APIError):
            raise outcome[0]
        return JSONResponse(outcome[0])

    async def models(self, request: Request) -> Response:
        service = self.service
        card = {
            "id": service.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "hybridkv",
            "max_model_len": service.max_model_len,
        }
        self.metrics_.requests.labels(endpoint="models", status="200").inc()
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        if self.service.engine.is_running:
            return JSONResponse({"status": "ok"})
        body = error_body("the engine is not running", "server_error")
        return JSONResponse(body, status_code=503)

    async def metrics(self, request: Request) -> Response:
        return Response(self.metrics_.render(), media_type=CONTENT_TYPE)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refusing it with 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(len(body), limit)
    return bytes(body)


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        f"the request body has at least {size} bytes; the limit is {limit}",
        status=413,
        code="request_too_large",
    )


async def _cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    # The body has been read, so the next message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
    log.info("client_disconnected", path=request.url.path)
    scope.cancel()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    body = error_body(exc.detail, "invalid_request_error", code=str(exc.status_code))
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)
