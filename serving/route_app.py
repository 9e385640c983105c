"""The data-parallel front end: one OpenAI-compatible address over several replicas.

::

    client ── POST /v1/chat/completions ──> front end: read the body, tokenize the prompt
                                            as the replicas do, order the healthy
                                            replicas (replicas.py), forward to the first
                                            ── a transport failure or a 503 before any
                                               byte came back: out of rotation, next one
    client <── the replica's answer, as it streams, with ``X-HybridKV-Replica`` ──┘

A request is retried on the next replica only while nothing of its answer has reached
the client: a stream whose replica fails after its first event ends with an error event
(``{"error": {...}}``) naming the replica. ``/v1/responses`` with a
``previous_response_id`` goes where that response was made (its store is the
replica's). Everything else (``/v1/models``, ``/tokenize``, ``/detokenize``,
``/version``) goes to the least busy healthy replica. ``/health`` lists every replica
(200 while one serves, else 503); ``/metrics`` is the front end's and every replica's
(``route_metrics.py``).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Sequence
from typing import Any

import anyio
import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hybridkv.errors.events import get_logger
from hybridkv.serving.app import guarded
from hybridkv.serving.body import decode_json, read_body
from hybridkv.serving.errors import APIError, error_body
from hybridkv.serving.guard import AccessGuard
from hybridkv.serving.metrics import CONTENT_TYPE
from hybridkv.serving.prompts import Prompter
from hybridkv.serving.protocol import parse_chat, parse_completion
from hybridkv.serving.replicas import Replica, ReplicaSet
from hybridkv.serving.route_metrics import RouterMetrics
from hybridkv.serving.streaming import EventStreamResponse, cancel_on_disconnect

log = get_logger(__name__)

#: The header naming the replica that answered.
REPLICA_HEADER = "x-hybridkv-replica"
_FORWARDED_HEADERS = ("content-type", "accept", "authorization", "x-request-id")
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[^"]+)"')
_REMEMBERED_RESPONSES = 65_536


class Forwarder:
    """Forwards requests over a :class:`ReplicaSet` (see the module docstring).

    Args:
        replicas: The replicas and their routing policy.
        prompter: Tokenizes prompts as the replicas do (None: route by load alone).
        max_body_bytes: Largest request body (413 beyond).
        body_timeout_s: Seconds a body may take to arrive (408 beyond).
    """

    def __init__(
        self,
        replicas: ReplicaSet,
        prompter: Prompter | None,
        *,
        max_body_bytes: int = 4 * 2**20,
        body_timeout_s: float = 30.0,
    ) -> None:
        self.replicas = replicas
        self.prompter = prompter
        self.counters = RouterMetrics(replicas)
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self._responses: OrderedDict[str, str] = OrderedDict()

    # -- routes -----------------------------------------------------------------------

    async def generation(self, request: Request) -> Response:
        raw = await read_body(request, max_bytes=self.max_body_bytes, timeout_s=self.body_timeout_s)
        token_ids, extra_keys, stream = await self._prompt(request.url.path, raw)
        order = self.replicas.order(token_ids, extra_keys)
        forward = self._forward(
            request, raw, order, stream=stream, token_ids=token_ids, extra_keys=extra_keys
        )
        return await self._until_gone(request, forward)

    async def responses(self, request: Request) -> Response:
        raw = await read_body(request, max_bytes=self.max_body_bytes, timeout_s=self.body_timeout_s)
        body = await self._json(raw)
        order = self.replicas.order(None)
        made_by = self._responses.get(str(body.get("previous_response_id")))
        order.sort(key=lambda r: r.name != made_by)  # where its store is, first
        stream = body.get("stream") is True
        return await self._until_gone(request, self._forward(request, raw, order, stream=stream))

    async def other(self, request: Request) -> Response:
        raw = await request.body() if request.method == "POST" else b""
        return await self._forward(request, raw, self.replicas.order(None), stream=False)

    async def health(self, request: Request) -> Response:
        replicas = self.replicas.replicas.values()
        body = {"replicas": {r.name: r.describe() for r in replicas}}
        status = 200 if any(r.healthy for r in replicas) else 503
        return JSONResponse(body, status_code=status)

    async def metrics(self, request: Request) -> Response:
        texts: dict[str, str] = {}

        async def scrape(replica: Replica) -> None:
            try:
                answer = await self.replicas.client.get(f"{replica.url}/metrics", timeout=10.0)
            except httpx.HTTPError:
                return
            if answer.status_code == 200:
                texts[replica.name] = answer.text

        async with anyio.create_task_group() as tg:
            for replica in self.replicas.healthy:
                tg.start_soon(scrape, replica)
        ordered = {name: texts[name] for name in sorted(texts)}
        return Response(self.counters.render(ordered), media_type=CONTENT_TYPE)

    # -- forwarding -------------------------------------------------------------------

    async def _until_gone(self, request: Request, forward: Awaitable[Response]) -> Response:
        """``forward``'s response, or a 499 once the client left (which cancels it, and
        so the replica's request: its connection closes)."""
        response: Response = Response(status_code=499)  # nobody reads it: the client left
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_on_disconnect, request.receive, tg.cancel_scope, request.url.path)
            response = await forward
            tg.cancel_scope.cancel()
        return response

    async def _prompt(
        self, path: str, raw: bytes
    ) -> tuple[list[int] | None, tuple[Hashable, ...], bool]:
        """The prompt's tokens as a replica will see them, its cache salt, and whether it
        streams; a body the front end cannot read goes by load (its replica answers
        the error)."""
        body = await self._json(raw)
        stream = body.get("stream") is True
        if self.prompter is None:
            return None, (), stream
        try:
            if path.endswith("/chat/completions"):
                parsed = parse_chat(body, auto_tools=True)
            else:
                parsed = parse_completion(body)
            if (
                isinstance(parsed.prompt, list)
                and parsed.prompt
                and (not isinstance(parsed.prompt[0], int))
            ):
                return None, (), stream  # a batch of prompts: no one prefix to follow
            token_ids = await self.prompter.token_ids(parsed)
        except (APIError, TypeError, ValueError):
            return None, (), stream
        salt = parsed.cache_salt
        return token_ids, (() if salt is None else (salt,)), stream

    async def _json(self, raw: bytes) -> dict[str, Any]:
        try:
            limiter = self.prompter.limiter if self.prompter is not None else None
            if limiter is None:
                body = json.loads(raw)
            else:
                body = await decode_json(raw, limiter)
        except (APIError, ValueError):
            return {}
        return body if isinstance(body, dict) else {}

    async def _forward(
        self,
        request: Request,
        raw: bytes,
        order: Sequence[Replica],
        *,
        stream: bool,
        token_ids: list[int] | None = None,
        extra_keys: tuple[Hashable, ...] = (),
    ) -> Response:
        headers = {k: v for k in _FORWARDED_HEADERS if (v := request.headers.get(k))}
        failures: list[str] = []
        for replica in order:
            url = f"{replica.url}{request.url.path}"
            if request.url.query:
                url = f"{url}?{request.url.query}"
            upstream = self.replicas.client.build_request(
                request.method, url, content=raw, headers=headers
            )
            replica.in_flight += 1
            handed_over = False
            try:
                answer = await self.replicas.client.send(upstream, stream=True)
                try:
                    if answer.status_code == 503:
                        reason = f"answered 503: {(await answer.aread())[:200]!r}"
                        self.replicas.mark_down(replica, reason)
                        failures.append(f"{replica.name}: {reason}")
                        self.counters.failed_tries.labels(replica.name).inc()
                        continue
                    self.replicas.sent(replica, token_ids, extra_keys)
                    if stream and answer.status_code == 200:
                        chunks = answer.aiter_raw()
                        first = await anext(chunks, b"")
                        response = self._stream(replica, answer, first, chunks)
                        handed_over = True
                        return response
                    body = await answer.aread()
                finally:
                    if not handed_over:
                        await answer.aclose()
            except httpx.TransportError as exc:
                reason = f"{type(exc).__name__}: {exc}".rstrip(": ")
                self.replicas.mark_down(replica, reason)
                failures.append(f"{replica.name}: {reason}")
                self.counters.failed_tries.labels(replica.name).inc()
                continue
            finally:
                if not handed_over:
                    replica.in_flight -= 1
            self._remember_response(replica, body)
            self.counters.requests.labels(replica.name, str(answer.status_code)).inc()
            kept = {"content-type": answer.headers.get("content-type", "application/json")}
            kept[REPLICA_HEADER] = replica.name
            return Response(body, status_code=answer.status_code, headers=kept)
        self.counters.unrouted.inc()
        if not order:
            states = "; ".join(f"{r.name}: {r.reason}" for r in self.replicas.replicas.values())
            message = f"no replica is serving ({states})"
        else:
            message = f"no replica could take the request ({'; '.join(failures)})"
        log.warning("request_unrouted", path=request.url.path, reason=message)
        return JSONResponse(error_body(message, "ServiceUnavailableError"), status_code=503)

    def _stream(
        self,
        replica: Replica,
        answer: httpx.Response,
        first: bytes,
        chunks: AsyncIterator[bytes],
    ) -> Response:
        async def produce(emit: Callable[[bytes], Awaitable[None]]) -> None:
            try:
                self._remember_response(replica, first)
                await emit(first)
                try:
                    async for chunk in chunks:
                        await emit(chunk)
                except httpx.TransportError as exc:
                    reason = f"{type(exc).__name__}: {exc}".rstrip(": ")
                    self.replicas.mark_down(replica, reason)
                    message = f"replica {replica.name} failed while streaming: {reason}"
                    log.warning("stream_broken", replica=replica.name, reason=reason)
                    event = {"error": error_body(message, "ServiceUnavailableError")["error"]}
                    await emit(f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())
                    return
                self.counters.requests.labels(replica.name, "200").inc()
            finally:
                replica.in_flight -= 1
                with anyio.CancelScope(shield=True):
                    await answer.aclose()

        response = EventStreamResponse(produce, lambda: None)
        response.raw_headers.append((REPLICA_HEADER.encode(), replica.name.encode()))
        return response

    def _remember_response(self, replica: Replica, body: bytes) -> None:
        """Where a Responses API answer was made, for a later ``previous_response_id``."""
        found = _RESPONSE_ID.search(body[:4096])
        if found is None:
            return
        self._responses[found.group(1).decode()] = replica.name
        while len(self._responses) > _REMEMBERED_RESPONSES:
            self._responses.popitem(last=False)


def build_route_app(forwarder: Forwarder, *, api_key: str | None = None) -> Starlette:
    """The front end's ASGI app around ``forwarder``."""
    generation = guarded(forwarder.generation)
    other = guarded(forwarder.other)
    return Starlette(
        routes=[
            Route("/v1/completions", generation, methods=["POST"]),
            Route("/v1/chat/completions", generation, methods=["POST"]),
            Route("/v1/responses", guarded(forwarder.responses), methods=["POST"]),
            Route("/v1/models", other, methods=["GET"]),
            Route("/v1/models/{model:path}", other, methods=["GET"]),
            Route("/tokenize", other, methods=["POST"]),
            Route("/detokenize", other, methods=["POST"]),
            Route("/version", other, methods=["GET"]),
            Route("/health", forwarder.health, methods=["GET"]),
            Route("/metrics", forwarder.metrics, methods=["GET"]),
        ],
        middleware=[Middleware(AccessGuard, api_key=api_key, allowed_hosts=())],
    )


__all__ = ["REPLICA_HEADER", "Forwarder", "build_route_app"]
