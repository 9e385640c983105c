"""Responses that end when the client leaves: a watcher of ``http.disconnect``, and the
server-sent-event response that runs a request's choices while it streams them.

::

    EventStreamResponse  task group: watch receive() for http.disconnect --cancel--+
                                     produce(emit): the choices, each emitting    <-+
                                     chunks; emit sends them one at a time

When the client disconnects (or stops reading, which the connection layer turns into a
disconnect) the watcher logs ``client_disconnected`` once, at info level, and cancels
the producers: their engine streams close, which aborts the requests. No traceback, no
error line. The producer never yields inside the task group: it calls ``emit``.

When the server begins a graceful shutdown (``serve_http`` puts a :class:`Stopping` in
each request's scope under :data:`STOPPING_KEY` and sets it then), every open stream is
cancelled likewise and ends with an error event and ``[DONE]``, never a cut connection
(a stream registers its scope there: no task per stream waits for the shutdown)::

    data: {"error": {"message": "the server is shutting down", "type": ...}}
    data: [DONE]
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from hybridkv.errors.events import get_logger
from hybridkv.serving.openai.errors import error_body

log = get_logger(__name__)

#: Sends one chunk of the body.
Emit = Callable[[bytes], Awaitable[None]]

#: The ASGI scope key of the event a server sets when it begins to shut down.
STOPPING_KEY = "hybridkv.stopping"

#: The last events of a stream the server's shutdown ended.
SHUTDOWN_EVENTS = (
    "data: "
    + json.dumps(
        {"error": error_body("the server is shutting down", "ServiceUnavailableError")["error"]}
    )
    + "\n\ndata: [DONE]\n\n"
).encode()


class Stopping:
    """Set once, when the server begins to shut down: it cancels every scope registered
    (the open streams) then, and any registered after at once."""

    def __init__(self) -> None:
        self._set = False
        self._scopes: set[anyio.CancelScope] = set()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        for scope in list(self._scopes):
            scope.cancel()

    def register(self, scope: anyio.CancelScope) -> None:
        """Cancel ``scope`` at the shutdown (now, if it began); :meth:`discard` it once
        it exits."""
        if self._set:
            scope.cancel()
        self._scopes.add(scope)

    def discard(self, scope: anyio.CancelScope) -> None:
        self._scopes.discard(scope)


async def until_disconnect(receive: Receive, path: str) -> None:
    """Return once the client disconnects, logged once at info (the request body must
    have been read: the next message can only be the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    log.info("client_disconnected", path=path)


async def cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope, path: str) -> None:
    """Cancel ``scope`` once the client disconnects (:func:`until_disconnect`)."""
    await until_disconnect(receive, path)
    scope.cancel()


class EventStreamResponse(Response):
    """A ``text/event-stream`` response whose body ``produce`` sends through ``emit``.

    Args:
        produce: Sends the events; cancelled if the client disconnects.
        on_close: Called however the response ends (to abort what still runs).
    """

    #: Whether ``produce`` emits from one task only (no lock between its chunks then).
    one_producer = False

    def __init__(self, produce: Callable[[Emit], Awaitable[None]], on_close: Callable[[], None]):
        # Not Response.__init__: it would declare a Content-Length for an empty body.
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        self._produce = produce
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_on_disconnect, receive, tg.cancel_scope, scope["path"])
                finished = await self.send_events(scope, send, tg.cancel_scope)
                tg.cancel_scope.cancel()
        finally:
            self._on_close()
        await self.send_end(scope, send, finished=finished)

    async def send_events(self, scope: Scope, send: Send, cancelled_by: anyio.CancelScope) -> bool:
        """The head and every event; True once ``produce`` returned. Run inside
        ``cancelled_by``: the scope a disconnect cancels, and the server's shutdown too."""
        lock = anyio.Lock(fast_acquire=True)  # uncontended: no trip through the loop
        stopping: Stopping | None = scope.get(STOPPING_KEY)

        async def emit(data: bytes) -> None:
            async with lock:  # choices emit concurrently; chunks must not interleave
                await send({"type": "http.response.body", "body": data, "more_body": True})

        async def emit_alone(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        start = {"status": self.status_code, "headers": self.raw_headers}
        await send({"type": "http.response.start", **start})
        if stopping is not None:
            stopping.register(cancelled_by)
        try:
            await self._produce(emit_alone if self.one_producer else emit)
        finally:
            if stopping is not None:
                stopping.discard(cancelled_by)
        return True

    async def send_end(self, scope: Scope, send: Send, *, finished: bool) -> None:
        """The stream's end, once :meth:`send_events` returned (``finished``) or was
        cancelled: the shutdown's events first where the shutdown cancelled it; nothing
        where the client left."""
        stopping: Stopping | None = scope.get(STOPPING_KEY)
        if stopping is not None and stopping.is_set() and not finished:
            log.info("stream_ended_by_shutdown", path=scope["path"])
            await send({"type": "http.response.body", "body": SHUTDOWN_EVENTS, "more_body": True})
            finished = True
        if finished:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
