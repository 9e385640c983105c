"""Run the HTTP app with uvicorn inside the caller's event loop, next to the engine.

This is what an application embedding hybridkv does::

    async with Engine(config, executor) as engine:
        app = build_app(engine, tokenizer, model_name="m", max_model_len=8192)
        await serve_http(app, open_socket("127.0.0.1", 8000))

The socket is bound before serving so that a port in use is a clear error, not a
uvicorn exit, and so tests can bind port 0 and learn the port chosen.
"""

from __future__ import annotations

import socket

import anyio
import anyio.abc
import uvicorn
from starlette.types import ASGIApp

from hybridkv.errors import HybridKVError
from hybridkv.serving.connection import ConnectionLimits


class ListenError(HybridKVError, OSError):
    """The server cannot listen on the address asked for."""


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
        sock = socket.socket(info[0], socket.SOCK_STREAM)
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
    ``limits`` bound the connections and their timeouts (connection.py).
    """
    limits = limits or ConnectionLimits()
    config = uvicorn.Config(
        app,
        http=limits.protocol(),
        log_level=log_level,
        lifespan="off",
        timeout_keep_alive=limits.idle_timeout_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=5,
        access_log=log_level in ("debug", "info"),
    )
    server = uvicorn.Server(config)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_serve, server, sock)
        # uvicorn has no readiness callback: poll its flag (set within a few ms).
        while not server.started:
            await anyio.sleep(0.01)
        task_status.started(server)


async def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
    try:
        await server.serve(sockets=[sock])
    finally:
        sock.close()


def bound_port(sock: socket.socket) -> int:
    """The port a socket is bound to."""
    return int(sock.getsockname()[1])
