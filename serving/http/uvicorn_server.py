"""Run the HTTP app with uvicorn inside the caller's event loop, next to the engine.

This is what an application embedding hybridkv does::

    async with Engine(config, executor) as engine:
        app = build_app(engine, tokenizer, model_name="m", max_model_len=8192)
        await serve_http(app, open_socket("127.0.0.1", 8000))

The socket is bound before serving so that a port in use is a clear error, not a
uvicorn exit, and so tests can bind port 0 and learn the port chosen.

A graceful shutdown (SIGTERM, SIGINT, ``should_exit``) first tells every open event
stream, which ends with an error event and ``[DONE]`` (``streaming.py``); uvicorn then
waits for the connections to finish, so none is cut while the server stops.

While it serves, the loop's exception handler logs a failing ``accept()`` (EMFILE, out of
descriptors, and its kin) at most once a second, with the count of those left out:
asyncio logs each with a traceback, once per connection waiting in the backlog, which
under a descriptor limit below the connection cap made 95 MB of log in 30 s. The cap
itself is fitted to the limit by :meth:`ConnectionLimits.fit_descriptor_limit` at start
(``hybridkv serve`` does it as it reads its flags, so the line comes before the model
loads), so that the cap, not the descriptors, is what runs out.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from hybridkv.errors import HybridKVError
from hybridkv.scheduler.loop_host import on_asyncio
from hybridkv.serving.http.connection import ConnectionLimits
from hybridkv.serving.http.rate_limited_log import RateLimitedLog
from hybridkv.serving.http.streaming import STOPPING_KEY, Stopping

#: The errors asyncio's accept loop reports and retries a second later.
ACCEPT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

#: How long asyncio waits before it listens again after a failed accept().
RETRY_DELAY_S = 1.0

ExceptionHandler = Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object]


class ListenError(HybridKVError, OSError):
    """The server cannot listen on the address asked for."""


class ServeBackendError(HybridKVError, RuntimeError):
    """``serve_http`` was called on an event loop uvicorn cannot run on (trio)."""


def open_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for ``host``:``port`` (port 0: any free port).

    Raises:
        ListenError: the port is out of range, or the address is in use, unknown, or
            not ours to bind.
    """
    if not 0 <= port <= 65535:
        # bind() would silently take the port modulo 65536.
        raise ListenError(f"cannot listen on {host}:{port}: port {port} is not in [0, 65535]")
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        # IPPROTO_TCP named, not 0: asyncio turns Nagle off (TCP_NODELAY) only on
        # accepted sockets whose proto says TCP; left on, an answer written as headers
        # then body waited for the client's delayed ACK, 40 ms a response.
        sock = socket.socket(info[0], socket.SOCK_STREAM, socket.IPPROTO_TCP)
    except OSError as exc:
        raise ListenError(f"cannot resolve host {host!r}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


async def serve_http(
    app: ASGIApp,
    sock: socket.socket,
    *,
    log_level: str = "warning",
    limits: ConnectionLimits | None = None,
    task_status: anyio.abc.TaskStatus[uvicorn.Server] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``sock`` until the server is told to exit (``should_exit``).

    With ``await tg.start(serve_http, app, sock)`` the caller gets the uvicorn server
    once it accepts connections, and stops it by setting ``server.should_exit = True``.
    asyncio only (uvicorn's loop); on trio, ``serve_hypercorn`` serves the same app.
    ``limits`` bound the connections and their timeouts (connection.py); the cap is
    fitted to the process's open-file limit first (logged if that changes anything).
    """
    if not on_asyncio():
        raise ServeBackendError(
            "serve_http runs uvicorn, which needs asyncio, and this loop is not asyncio's: "
            "on trio serve the app with hybridkv.serving.http.hypercorn_server.serve_hypercorn"
        )
    limits = (limits or ConnectionLimits()).fit_descriptor_limit()
    stopping = Stopping()

    async def announcing(scope: Scope, receive: Receive, send: Send) -> None:
        scope[STOPPING_KEY] = stopping
        await app(scope, receive, send)

    config = uvicorn.Config(
        announcing,
        http=limits.protocol(),
        ws="none",  # no websocket routes; an upgraded connection would leave the table
        log_level=log_level,
        log_config=None,  # uvicorn's records go to the application's logging, as any library's
        lifespan="off",
        timeout_keep_alive=limits.idle_timeout_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=5,
        access_log=log_level in ("debug", "info"),
    )
    server = _Server(config, stopping)
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    handler = AcceptErrorLog(previous)
    loop.set_exception_handler(handler)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_serve, server, sock)
            # uvicorn has no readiness callback: poll its flag (set within a few ms).
            while not server.started:
                await anyio.sleep(0.01)
            task_status.started(server)
    finally:
        # asyncio retries a listener a second after each failed accept(), closed or not:
        # after any, keep the handler until those retries have run.
        if handler.failures:
            loop.call_later(2 * RETRY_DELAY_S, _restore_handler, loop, handler, previous)
        else:
            _restore_handler(loop, handler, previous)


async def serve_http_in(
    tg: anyio.abc.TaskGroup, app: ASGIApp, sock: socket.socket, **options: Any
) -> uvicorn.Server:
    """Start :func:`serve_http` in ``tg``; return once it accepts connections (so that
    a line saying where it serves comes after it listens). ``tg`` is cancelled when the
    server stops, and the tasks that ran beside it with it."""

    async def run(*, task_status: anyio.abc.TaskStatus[uvicorn.Server]) -> None:
        await serve_http(app, sock, task_status=task_status, **options)
        tg.cancel_scope.cancel()

    server: uvicorn.Server = await tg.start(run)
    return server


def _restore_handler(
    loop: asyncio.AbstractEventLoop, handler: ExceptionHandler, previous: ExceptionHandler | None
) -> None:
    if loop.get_exception_handler() is handler:  # unless someone else replaced it since
        loop.set_exception_handler(previous)


class _Server(uvicorn.Server):
    """uvicorn's server, which tells the open streams when it begins to shut down."""

    def __init__(self, config: uvicorn.Config, stopping: Stopping) -> None:
        super().__init__(config)
        self.stopping = stopping

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.stopping.set()
        await super().shutdown(sockets)


async def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
    try:
        await server.serve(sockets=[sock])
    finally:
        sock.close()


class AcceptErrorLog:
    """An event loop exception handler: a failing ``accept()`` is one warning line at
    most once a second (``suppressed=N`` counts those left out since the last line, no
    traceback); anything else goes to the handler before it (or the loop's default).

    asyncio also schedules a retry of the listener a second after each failure (one per
    connection waiting in the backlog); those that fire once the listener has closed
    (at shutdown) fail too, and are one info line a second likewise.

    ``clock`` gives the time in seconds (a test passes its own).
    """

    def __init__(
        self, previous: ExceptionHandler | None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.previous = previous
        self.clock = clock
        self.limiter = RateLimitedLog("accept_failed")
        self.retries = RateLimitedLog("accept_retry_failed", level="info")
        self.failures = 0  # failed accept()s seen

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        callback = getattr(context.get("handle"), "_callback", None)
        if isinstance(exc, OSError) and exc.errno in ACCEPT_ERRNOS and "socket" in context:
            self.failures += 1
            name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            self.limiter(self.clock(), error=name, reason=exc.strerror)
        elif exc is not None and getattr(callback, "__name__", None) == "_start_serving":
            self.retries(self.clock(), error=repr(exc))
        elif self.previous is not None:
            self.previous(loop, context)
        else:
            loop.default_exception_handler(context)


def bound_port(sock: socket.socket) -> int:
    """The port a socket is bound to."""
    return int(sock.getsockname()[1])
