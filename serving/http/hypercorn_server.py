"""Serve the HTTP app with hypercorn: on trio, or on asyncio where uvicorn is not wanted.

:func:`~hybridkv.serving.http.uvicorn_server.serve_http` runs uvicorn, which needs asyncio. An
application on trio serves the same app (``build_app``) with :func:`serve_hypercorn`::

    async with Engine(config, executor) as engine:
        app = build_app(engine, tokenizer, model_name="m", max_model_len=8192)
        await serve_hypercorn(app, open_socket("127.0.0.1", 8000))

What it lacks against ``serve_http``: the protections of ``ConnectionLimits`` that live
in uvicorn's protocol (the connection caps and monitoring reserve, the first-byte, head
and write deadlines, the descriptor fit); hypercorn closes a kept-alive connection idle
for ``idle_timeout_s``. In front of untrusted clients, prefer ``serve_http`` on asyncio,
or a proxy that enforces those limits. Needs ``pip install 'hybridkv[trio]'``.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from typing import Any

import anyio
import anyio.abc
from starlette.types import ASGIApp

from hybridkv.scheduler.loop_host import on_asyncio


class HypercornServer:
    """A running :func:`serve_hypercorn`: set ``should_exit = True`` to stop it (as with
    uvicorn's server), from the loop's thread."""

    def __init__(self) -> None:
        self._stop = anyio.Event()

    @property
    def should_exit(self) -> bool:
        return self._stop.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self._stop.set()


async def serve_hypercorn(
    app: ASGIApp,
    sock: socket.socket,
    *,
    idle_timeout_s: float = 5.0,
    task_status: anyio.abc.TaskStatus[HypercornServer] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``sock`` (bound, from ``open_socket``) until told to exit.

    With ``await tg.start(serve_hypercorn, app, sock)`` the caller gets a
    :class:`HypercornServer` once the socket listens (connections made from then on are
    served); ``server.should_exit = True`` stops it, finishing the responses in flight.
    Hypercorn's logs go to the ``hypercorn.error`` logger (no handler of its own).
    """
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"fd://{os.dup(sock.fileno())}"]  # hypercorn closes the one it is given
    config.keep_alive_timeout = idle_timeout_s
    config.errorlog = logging.getLogger("hypercorn.error")
    config.accesslog = None
    config.graceful_timeout = 5.0
    serve: Any
    if on_asyncio():
        from hypercorn.asyncio import serve
    else:
        from hypercorn.trio import serve
    server = HypercornServer()
    sock.listen(config.backlog)  # from here on a connection waits in the backlog
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(serve, app, config, shutdown_trigger=server._stop.wait))
            task_status.started(server)
    finally:
        sock.close()
