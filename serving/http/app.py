"""The OpenAI-compatible HTTP app (ASGI, Starlette) around a running engine.

::

    async with Engine(config, executor) as engine:
        app = build_app(engine, tokenizer, model_name="my-model", max_model_len=8192)
        await serve_http(app, open_socket("127.0.0.1", 8000))

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streamed as
server-sent events with ``"stream": true``), ``GET /v1/models``, ``GET
/v1/models/{model}``, ``POST /tokenize``, ``POST /detokenize`` (vLLM's), ``GET
/version``, ``GET /kv_events`` (where its KV events go, for a router), ``GET /load``
(its queues and free pages, for a router), ``GET /health``
(503 once the engine stopped), ``GET /metrics`` (Prometheus). Layers, outermost first::

    RequestCounter   every response counted by endpoint and status
    AccessGuard      Host allow-list, API key (guard.py)
    routes           body checks (bodies.py), parsing (protocol.py), the service

Every refusal is a 4xx/5xx with an OpenAI error body, and the server keeps serving. A
client that disconnects aborts its requests and is logged once, at info level.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import anyio
import attrs
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tokenizers import Tokenizer

from hybridkv.errors.events import get_logger
from hybridkv.executor.grammar_bounds import DEFAULT_LIMITS, GrammarLimits
from hybridkv.executor.grammar_guard import GrammarGuard
from hybridkv.scheduler import Engine
from hybridkv.serving.http.bodies import check_json_media_type, read_body
from hybridkv.serving.http.guard import AccessGuard, cors
from hybridkv.serving.http.headers import FREE_TOKENS_HEADER
from hybridkv.serving.http.streaming import EventStreamResponse, cancel_on_disconnect
from hybridkv.serving.http.utility_routes import UtilityRoutes, free_tokens
from hybridkv.serving.metrics.prometheus import (
    CONTENT_TYPE,
    OffloadCollector,
    RequestCounter,
    ServerMetrics,
)
from hybridkv.serving.openai.chat_template import ChatTemplate
from hybridkv.serving.openai.errors import APIError, ClientGoneError, error_body
from hybridkv.serving.openai.grammar_check import GrammarCheck, GrammarCompiler
from hybridkv.serving.openai.json_text import decode_json
from hybridkv.serving.openai.prompts import Prompter
from hybridkv.serving.openai.protocol import parse_chat, parse_completion
from hybridkv.serving.openai.response_bodies import DEFAULT_MAX_RESPONSE_BYTES
from hybridkv.serving.openai.responses_api import (
    EventTranslator,
    ResponseBuilder,
    ResponseStore,
    chat_body,
)
from hybridkv.serving.openai.service import GenerationService
from hybridkv.serving.openai.tools import PARSERS

if TYPE_CHECKING:
    from hybridkv.parallel.kv_events import KVEventPublisher

log = get_logger(__name__)


def _names(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class ServerOptions:
    """Limits and access rules of the HTTP layer.

    Attributes:
        max_body_bytes: Largest request body accepted (413 beyond).
        default_max_tokens: Output limit of a chat request that sets none; None lets it
            run to the end of the context.
        api_key: Clients must send ``Authorization: Bearer <api_key>`` (guard.py says
            where); None: no key.
        allowed_hosts: Host header names answered (``*.example.com`` allowed); empty:
            any.
        body_timeout_s: Seconds a request body may take to arrive (408 beyond).
        template_timeout_s: Seconds one chat-template rendering may take (400 beyond).
        max_preprocess_threads: Worker threads for rendering, tokenizing, decoding large
            bodies and checking grammars, over all requests.
        grammar_limits: The largest structured-output specs accepted (400 beyond).
        max_response_bytes: Largest response body, and largest event of a stream: a
            request whose answer would be larger (``echo`` with logprobs over a long
            prompt, many choices) gets a 400 naming the limit, and no larger body is ever
            built. Bodies with many logprobs are built and encoded in the preprocessing
            threads, so the loop keeps answering meanwhile.
        allowed_origins: Browser origins CORS allows (``*``: any); empty: no CORS
            headers, so browsers keep other sites' pages from reading the answers.
        tool_call_parser: How ``tool_choice: auto`` calls are read from the text
            (``hermes`` or ``json``, ``hybridkv.serving.openai.tools``); None: not at all.
        enable_auto_tool_choice: Let requests leave the call to the model (``auto``, the
            default when tools are sent); needs ``tool_call_parser``.
        any_whitespace: JSON output may hold any whitespace between tokens, unless a
            request's ``structured_outputs.disable_any_whitespace`` says otherwise.
        additional_properties: JSON output may hold properties a schema does not list
            (where it says nothing of others), unless a request says otherwise; False
            by default, as vLLM's default backend.
        strict_fields: Refuse a body with a field this server does not know (400), as
            OpenAI's API does; by default, as vLLM, such fields are ignored and listed in
            one ``request_fields_ignored`` warning per request.
        responses_store_bytes: Bytes of JSON the Responses API keeps of its stored
            conversations (besides its count of 1,024); the oldest are evicted first.
    """

    max_body_bytes: int = attrs.field(default=4 * 2**20, validator=attrs.validators.ge(1))
    default_max_tokens: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )
    api_key: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.min_len(1))
    )
    allowed_hosts: tuple[str, ...] = attrs.field(default=(), converter=_names)
    body_timeout_s: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))
    template_timeout_s: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    max_preprocess_threads: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    grammar_limits: GrammarLimits = DEFAULT_LIMITS
    max_response_bytes: int = attrs.field(
        default=DEFAULT_MAX_RESPONSE_BYTES, validator=attrs.validators.ge(1)
    )
    strict_fields: bool = False
    allowed_origins: tuple[str, ...] = ()
    tool_call_parser: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(PARSERS))
    )
    enable_auto_tool_choice: bool = False
    any_whitespace: bool = True
    additional_properties: bool = False
    responses_store_bytes: int = attrs.field(default=256 << 20, validator=attrs.validators.ge(1))


def build_app(
    engine: Engine,
    tokenizer: Tokenizer,
    *,
    model_name: str,
    max_model_len: int,
    chat_template: ChatTemplate | None = None,
    options: ServerOptions | None = None,
    kv_events: KVEventPublisher | None = None,
) -> Starlette:
    """The ASGI app serving ``engine`` under the name ``model_name`` (``kv_events``: the
    engine's publisher, described at ``GET /kv_events``)."""
    options = options or ServerOptions()
    policies = [p.name for p in engine.config.policies]
    metrics = ServerMetrics(engine.stats, policies, model_name)
    if engine.core.offload is not None:
        metrics.registry.register(OffloadCollector(engine.core.offload.stats))
    prompter = Prompter(
        tokenizer,
        chat_template or ChatTemplate.plain(),
        max_model_len=max_model_len,
        limiter=anyio.CapacityLimiter(options.max_preprocess_threads),
        template_timeout_s=options.template_timeout_s,
    )
    executor = engine.executor
    grammars = GrammarCheck(
        GrammarGuard(limits=options.grammar_limits),
        executor if isinstance(executor, GrammarCompiler) else None,
        prompter.limiter,
    )
    service = GenerationService(
        engine,
        prompter,
        grammars,
        model_name=model_name,
        metrics=metrics,
        default_max_tokens=options.default_max_tokens,
        max_response_bytes=options.max_response_bytes,
    )
    routes = _Routes(service, metrics, options)
    utility = UtilityRoutes(service, routes.read_json, kv_events)
    app = Starlette(
        routes=[
            Route("/v1/completions", routes.generation(parse_completion), methods=["POST"]),
            Route(
                "/v1/chat/completions",
                routes.generation(
                    functools.partial(
                        parse_chat,
                        tool_parser=options.tool_call_parser,
                        auto_tools=options.enable_auto_tool_choice,
                    )
                ),
                methods=["POST"],
            ),
            Route("/v1/responses", routes.guarded(routes.responses), methods=["POST"]),
            Route("/v1/models", utility.models, methods=["GET"]),
            Route("/v1/models/{model:path}", utility.model, methods=["GET"]),
            Route("/tokenize", routes.guarded(utility.tokenize), methods=["POST"]),
            Route("/detokenize", routes.guarded(utility.detokenize), methods=["POST"]),
            Route("/version", utility.version, methods=["GET"]),
            Route("/kv_events", utility.kv_events_info, methods=["GET"]),
            Route("/load", utility.load, methods=["GET"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
        ],
        middleware=[
            *cors(options.allowed_origins),
            Middleware(RequestCounter, metrics=metrics),
            Middleware(AccessGuard, api_key=options.api_key, allowed_hosts=options.allowed_hosts),
        ],
        exception_handlers={HTTPException: _http_error},  # type: ignore[dict-item]
    )
    app.state.service = service
    app.state.metrics = metrics
    return app


Handler = Callable[[Request], Awaitable[Response]]


def guarded(handler: Handler) -> Handler:
    """``handler`` with every failure turned into a response: an APIError's body, a
    disconnect logged once at info, anything else a 500 logged with its traceback."""

    async def handle(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as exc:
            # A body not read to its end leaves the connection unusable: close it.
            headers = {"Connection": "close"} if exc.status in (408, 413) else None
            return JSONResponse(exc.body(), status_code=exc.status, headers=headers)
        except ClientGoneError:
            log.info("client_disconnected", path=request.url.path, phase="request")
            return Response(status_code=499)  # nobody reads it: the client has gone
        except Exception:
            log.exception("request_failed", path=request.url.path)
            body = error_body("internal server error", "server_error")
            return JSONResponse(body, status_code=500)

    return handle


def _json_defaults(parsed: Any, options: ServerOptions) -> Any:
    """The request with the server's JSON output options where it sets none."""
    wanted = parsed.sampling.structured_output
    if wanted is None or None not in (wanted.any_whitespace, wanted.additional_properties):
        return parsed
    wanted = attrs.evolve(
        wanted,
        any_whitespace=_first(wanted.any_whitespace, options.any_whitespace),
        additional_properties=_first(wanted.additional_properties, options.additional_properties),
    )
    return attrs.evolve(parsed, sampling=attrs.evolve(parsed.sampling, structured_output=wanted))


def _first(value: bool | None, default: bool) -> bool:
    return default if value is None else value


class _Routes:
    def __init__(self, service: GenerationService, metrics: ServerMetrics, options: ServerOptions):
        self.service = service
        self.metrics_ = metrics
        self.options = options
        self.store = ResponseStore(max_bytes=options.responses_store_bytes)

    async def read_json(self, request: Request) -> dict[str, Any]:
        """The request's JSON object, through every check of bodies.py."""
        check_json_media_type(request)
        options = self.options
        raw = await read_body(
            request, max_bytes=options.max_body_bytes, timeout_s=options.body_timeout_s
        )
        return await decode_json(raw, self.service.prompter.limiter)

    def guarded(self, handler: Handler) -> Handler:
        """``handler`` with every failure turned into a response (:func:`guarded`)."""
        return guarded(handler)

    def generation(self, parse: Callable[..., Any]) -> Handler:
        """The handler of a generation endpoint whose body ``parse`` reads."""

        async def handle(request: Request) -> Response:
            parsed = parse(await self.read_json(request), strict=self.options.strict_fields)
            parsed = _json_defaults(parsed, self.options)
            if parsed.ignored_fields:
                fields = list(parsed.ignored_fields)
                log.warning("request_fields_ignored", path=request.url.path, fields=fields)
            job = await self.service.submit(parsed)
            if parsed.stream:
                response: Response = EventStreamResponse(
                    lambda emit: self.service.stream(job, emit), lambda: self.service.close(job)
                )
            else:
                body = await self.whole(request, job)
                if body is None:
                    return Response(status_code=499)  # nobody reads it: the client has gone
                # Encoded already (off the loop when large): JSONResponse would encode again.
                response = Response(body, media_type="application/json")
            # A front end hears this replica's load from its answers (``replicas.py``).
            header = (FREE_TOKENS_HEADER.encode(), str(free_tokens(self.service)).encode())
            response.raw_headers.append(header)
            return response

        return self.guarded(handle)

    async def whole(self, request: Request, job: Any) -> bytes | None:
        """Run ``job`` to its end and return its body; None if the client left (the
        request is aborted then)."""
        outcome: list[bytes | APIError] = []

        async def complete() -> None:
            try:
                outcome.append(await self.service.complete(job))
            except APIError as exc:
                outcome.append(exc)
            tg.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    cancel_on_disconnect, request.receive, tg.cancel_scope, request.url.path
                )
                tg.start_soon(complete)
        finally:
            self.service.close(job)
        if not outcome:
            return None
        if isinstance(outcome[0], APIError):
            raise outcome[0]
        return outcome[0]

    async def responses(self, request: Request) -> Response:
        """``POST /v1/responses`` (``hybridkv.serving.openai.responses_api``)."""
        body = await self.read_json(request)
        chat, ignored = chat_body(body, self.store)
        if ignored and self.options.strict_fields:
            names = ", ".join(repr(name) for name in sorted(ignored))
            raise APIError(f"unrecognized request argument(s): {names}", param=sorted(ignored)[0])
        if ignored:
            log.warning("request_fields_ignored", path=request.url.path, fields=sorted(ignored))
        options = self.options
        parsed = parse_chat(
            chat, tool_parser=options.tool_call_parser, auto_tools=options.enable_auto_tool_choice
        )
        parsed = _json_defaults(parsed, options)
        job = await self.service.submit(parsed)
        builder = ResponseBuilder(parsed.model, body, chat)
        keep = body.get("store", True) is not False
        if parsed.stream:

            async def produce(emit: Any) -> None:
                translator = EventTranslator(builder, emit)
                await translator.start()
                await self.service.stream(job, translator)
                if keep:
                    self.store.put(builder.id, builder.conversation())

            return EventStreamResponse(produce, lambda: self.service.close(job))
        whole = await self.whole(request, job)
        if whole is None:
            return Response(status_code=499)
        builder.take_chat(json.loads(whole))
        if keep:
            self.store.put(builder.id, builder.conversation())
        return JSONResponse(builder.response("completed"))

    async def health(self, request: Request) -> Response:
        engine = self.service.engine
        if engine.is_running:
            return JSONResponse({"status": "ok"})
        reason = f": {engine.error}" if engine.error is not None else ""
        body = error_body(f"the engine is not running{reason}", "server_error")
        return JSONResponse(body, status_code=503)

    async def metrics(self, request: Request) -> Response:
        return Response(self.metrics_.render(), media_type=CONTENT_TYPE)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    body = error_body(exc.detail, "invalid_request_error", code=str(exc.status_code))
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)
