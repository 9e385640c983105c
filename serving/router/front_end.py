"""The data-parallel front end: one OpenAI-compatible address over several replicas.

::

    client ── POST /v1/chat/completions ──> front end: read the body (the replicas'
                                            limits), tokenize the prompt as the replicas
                                            do, order the healthy replicas (replicas.py),
                                            forward to the first
                                            ── a failure before any byte came back: the
                                               next one (a refused connection or a 503
                                               also takes it out of rotation)
    client <── the replica's answer, as it streams, with ``X-HybridKV-Replica`` ──┘

A request is retried on the next replica only while nothing of its answer has reached
the client: a stream whose replica fails, stalls or leaves the rotation after its first
event ends with an error event (``{"error": {...}}``) naming the replica.
``/v1/responses`` with a ``previous_response_id`` goes where that response was made (its
store is the replica's). Everything else (``/v1/models``, ``/tokenize``,
``/detokenize``, ``/version``) goes to the least busy healthy replica. ``/health`` says
whether one serves (200, else 503) and, to a request with the key, every replica's
state; ``/metrics`` is the front end's and every replica's (``front_end_metrics.py``).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Sequence
from typing import Any

import anyio
import attrs
import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hybridkv.errors.events import get_logger
from hybridkv.serving.http.app import guarded
from hybridkv.serving.http.bodies import read_body
from hybridkv.serving.http.guard import AccessGuard, KeyCheck, cors
from hybridkv.serving.metrics.prometheus import CONTENT_TYPE
from hybridkv.serving.openai.errors import error_body
from hybridkv.serving.openai.prompts import Prompter
from hybridkv.serving.router.front_end_metrics import RouterMetrics
from hybridkv.serving.router.relay import ClientWatch, RelayedStream
from hybridkv.serving.router.replicas import Replica, ReplicaSet
from hybridkv.serving.router.routed_prompt import lenient_json, routed_prompt
from hybridkv.serving.router.upstream import (
    UpstreamAnswer,
    UpstreamConnectError,
    UpstreamError,
)

log = get_logger(__name__)


@attrs.frozen(kw_only=True)
class UpstreamTimeouts:
    """How long a forward waits on its replica.

    Attributes:
        first_byte_s: For the first byte of a stream or of a short answer (models,
            tokenize, ...): the replicas' step timeout by default (vLLM's 60 s). A try
            that runs out goes to the next replica, as nothing reached the client yet.
        stall_s: Between two bytes of a stream, once it started: then it ends with an
            error event.
    """

    first_byte_s: float | None = 60.0
    stall_s: float | None = 60.0


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
        max_body_bytes: Largest request body, on every route (413 beyond), as the
            replicas' own limit: a body they would refuse never reaches them.
        body_timeout_s: Seconds a body may take to arrive (408 beyond).
        timeouts: How long a forward may wait on its replica.
        api_key: With a key, ``/health`` shows its replicas only to a request with it.
    """

    def __init__(
        self,
        replicas: ReplicaSet,
        prompter: Prompter | None,
        *,
        max_body_bytes: int = 4 * 2**20,
        body_timeout_s: float = 30.0,
        timeouts: UpstreamTimeouts | None = None,
        api_key: str | None = None,
    ) -> None:
        self.replicas = replicas
        self.prompter = prompter
        self.counters = RouterMetrics(replicas)
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.timeouts = timeouts or UpstreamTimeouts()
        self._key_check = KeyCheck(api_key)
        self._responses: OrderedDict[str, str] = OrderedDict()

    # -- routes -----------------------------------------------------------------------

    async def generation(self, request: Request) -> Response:
        raw = await self._body(request)
        body = await lenient_json(raw, self.prompter)
        stream = body.get("stream") is True
        token_ids, extra_keys = await routed_prompt(self.prompter, request.url.path, body)
        order = self.replicas.order(token_ids, extra_keys)
        forward = self._forward(
            request,
            raw,
            order,
            stream=stream,
            first_byte_s=self._first_byte_s(stream),
            token_ids=token_ids,
            extra_keys=extra_keys,
        )
        return await self._until_gone(request, forward)

    async def responses(self, request: Request) -> Response:
        raw = await self._body(request)
        body = await lenient_json(raw, self.prompter)
        order = self.replicas.order(None)
        made_by = self._responses.get(str(body.get("previous_response_id")))
        order.sort(key=lambda r: r.name != made_by)  # where its store is, first
        stream = body.get("stream") is True
        forward = self._forward(
            request, raw, order, stream=stream, first_byte_s=self._first_byte_s(stream)
        )
        return await self._until_gone(request, forward)

    async def other(self, request: Request) -> Response:
        raw = await self._body(request) if request.method == "POST" else b""
        order = self.replicas.order(None)
        first_byte_s = self.timeouts.first_byte_s
        return await self._forward(request, raw, order, stream=False, first_byte_s=first_byte_s)

    async def health(self, request: Request) -> Response:
        """200 while a replica serves, else 503; each replica's state (its address and
        process among it) only where no key is set or the request has it."""
        replicas = self.replicas.replicas.values()
        status = 200 if any(r.healthy for r in replicas) else 503
        body: dict[str, Any] = {"status": "ok" if status == 200 else "no replica is serving"}
        if self._key_check.passes(request.headers):
            body["replicas"] = {r.name: r.describe() for r in replicas}
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

    async def _body(self, request: Request) -> bytes:
        return await read_body(
            request, max_bytes=self.max_body_bytes, timeout_s=self.body_timeout_s
        )

    def _first_byte_s(self, stream: bool) -> float | None:
        """A stream's first event comes after one step; a whole generation sends nothing
        until it ends, and is bounded by its replica staying in rotation instead."""
        return self.timeouts.first_byte_s if stream else None

    async def _until_gone(self, request: Request, forward: Awaitable[Response]) -> Response:
        """``forward``'s response, or a 499 once the client left (which cancels it, and
        so the replica's request: its connection closes). A stream takes the watch on."""
        watch = ClientWatch(request.receive, request.url.path)
        handed_over = False
        try:
            with anyio.CancelScope() as scope:
                watch.cancels(scope)
                response = await forward
            if scope.cancelled_caught:
                return Response(status_code=499)  # nobody reads it: the client left
            if isinstance(response, RelayedStream):
                response.watch, handed_over = watch, True
            return response
        finally:
            if not handed_over:
                watch.stop()

    async def _forward(
        self,
        request: Request,
        raw: bytes,
        order: Sequence[Replica],
        *,
        stream: bool,
        first_byte_s: float | None,
        token_ids: list[int] | None = None,
        extra_keys: tuple[Hashable, ...] = (),
    ) -> Response:
        """Forward to the first of ``order`` that takes the request; the next one on a
        failure before any byte reached the client (``first_byte_s``: the longest wait
        for the answer's first byte; None: none)."""
        headers = [(k, v) for k in _FORWARDED_HEADERS if (v := request.headers.get(k))]
        path = request.url.path
        if request.url.query:
            path = f"{path}?{request.url.query}"
        failures: list[str] = []
        for replica in order:
            replica.in_flight += 1
            handed_over = False
            scope = anyio.CancelScope()
            replica.forwards.add(scope)
            try:
                with scope:
                    try:
                        with anyio.fail_after(first_byte_s):
                            answer = await self.replicas.upstream.send(
                                f"{replica.url}{path}",
                                request.method,
                                headers,
                                raw,
                                write_timeout_s=self.body_timeout_s,
                            )
                    except UpstreamConnectError as exc:
                        # Only a connection that cannot be made takes a replica out: one
                        # that fails while a body is sent (a replica refusing it) does not.
                        self.replicas.mark_down(replica, str(exc))
                        failures.append(self._failed(replica, str(exc)))
                        continue
                    except UpstreamError as exc:
                        failures.append(self._failed(replica, str(exc)))
                        continue
                    except TimeoutError:
                        reason = f"no answer within {first_byte_s:g} s"
                        failures.append(self._failed(replica, reason))
                        continue
                    try:
                        if answer.status_code == 503:
                            reason = f"answered 503: {(await answer.read())[:200]!r}"
                            self.replicas.mark_down(replica, reason)
                            failures.append(self._failed(replica, reason))
                            continue
                        self.replicas.sent(replica, token_ids, extra_keys)
                        self.replicas.heard_load(replica, answer.headers)
                        if stream and answer.status_code == 200:
                            chunks = answer.chunks(self.timeouts.stall_s)
                            with anyio.fail_after(first_byte_s):
                                first = await anext(chunks, b"")
                            handed_over = True
                            return self._stream(replica, answer, first, chunks)
                        body = await answer.read()
                    except (UpstreamError, TimeoutError) as exc:
                        failures.append(self._failed(replica, str(exc) or repr(exc)))
                        continue
                    finally:
                        if not handed_over:
                            await answer.aclose()
                if scope.cancelled_caught:  # it left the rotation while we waited
                    failures.append(self._failed(replica, f"left the rotation: {replica.reason}"))
                    continue
            finally:
                replica.forwards.discard(scope)
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

    def _failed(self, replica: Replica, reason: str) -> str:
        """Count a try that failed before any byte reached the client; its line."""
        self.counters.failed_tries.labels(replica.name).inc()
        return f"{replica.name}: {reason}"

    def _stream(
        self,
        replica: Replica,
        answer: UpstreamAnswer,
        first: bytes,
        chunks: AsyncIterator[bytes],
    ) -> Response:
        async def produce(emit: Callable[[bytes], Awaitable[None]]) -> None:
            scope = anyio.CancelScope()
            replica.forwards.add(scope)
            reason: str | None = None
            try:
                with scope:
                    self._remember_response(replica, first)
                    await emit(first)
                    try:
                        async for chunk in chunks:
                            await emit(chunk)
                    except UpstreamError as exc:
                        reason = str(exc)
                if scope.cancelled_caught:
                    reason = f"it left the rotation ({replica.reason})"
                if reason is None:
                    self.counters.requests.labels(replica.name, "200").inc()
                    return
                message = f"replica {replica.name} failed while streaming: {reason}"
                log.warning("stream_broken", replica=replica.name, reason=reason)
                event = {"error": error_body(message, "ServiceUnavailableError")["error"]}
                await emit(f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())
            finally:
                replica.forwards.discard(scope)
                replica.in_flight -= 1
                await answer.aclose()

        response = RelayedStream(produce, lambda: None)
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


def build_route_app(
    forwarder: Forwarder,
    *,
    api_key: str | None = None,
    allowed_hosts: Sequence[str] = (),
    allowed_origins: tuple[str, ...] = (),
) -> Starlette:
    """The front end's ASGI app around ``forwarder``, behind the same access guard (key,
    Host names) and CORS origins as a replica's."""
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
        middleware=[
            *cors(allowed_origins),
            Middleware(AccessGuard, api_key=api_key, allowed_hosts=allowed_hosts),
        ],
    )


__all__ = ["REPLICA_HEADER", "Forwarder", "UpstreamTimeouts", "build_route_app"]
