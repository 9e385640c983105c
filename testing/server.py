"""A live server for tests: the engine and the OpenAI-compatible app on a loopback port.

The server runs in an event loop thread of its own (an anyio blocking portal), as it
would in production, so a test talks to it over HTTP from plain synchronous code (the
official ``openai`` client, httpx) and reads the engine's state through the portal::

    with live_server(config, FakeExecutor.for_config(config), tokenizer=word_tokenizer()) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused")
        client.completions.create(model=s.model, prompt="w2 w3", max_tokens=4)
        s.wait_until_free()  # every page back: nothing leaked

On asyncio it is served by ``serve_http`` (uvicorn, with ``limits``); on trio by
``serve_hypercorn``.
"""

from __future__ import annotations

import contextlib
import functools
import socket
from collections.abc import Callable, Iterator
from typing import Any, Literal

import anyio
import anyio.abc
import attrs
from anyio.from_thread import BlockingPortal, start_blocking_portal

from hybridkv.scheduler import Engine, EngineConfig, EngineStats, Executor
from hybridkv.scheduler.loop_host import on_asyncio
from hybridkv.serving.http.app import ServerOptions, build_app
from hybridkv.serving.http.connection import ConnectionLimits
from hybridkv.serving.http.hypercorn_server import serve_hypercorn
from hybridkv.serving.http.uvicorn_server import bound_port, open_socket, serve_http
from hybridkv.serving.openai.chat_template import ChatTemplate
from hybridkv.testing.leaks import wait_until_free

Backend = Literal["asyncio", "trio"]


@attrs.frozen
class LiveServer:
    """A running server: its URL, model name, engine, app, executor, and the portal into
    its loop (``portal.call(fn, ...)`` runs ``fn`` on the loop's thread)."""

    url: str
    model: str
    engine: Engine
    app: Any
    executor: Executor
    portal: BlockingPortal
    http_server: Any = None

    def begin_shutdown(self) -> None:
        """Begin the HTTP server's graceful shutdown, as SIGTERM does: open streams end
        with an error event, and it stops listening (asyncio's uvicorn only)."""
        self.portal.call(setattr, self.http_server, "should_exit", True)

    def stats(self) -> EngineStats:
        """The engine's stats, read on the loop's thread."""
        return self.portal.call(self.engine.stats)

    def wait_until(
        self, predicate: Callable[[EngineStats], bool], timeout: float = 60.0
    ) -> EngineStats:
        """Return the stats once ``predicate(stats)`` holds (waited for on the engine's
        events; ``timeout`` bounds a wait that should end, it is no delay)."""

        async def wait() -> EngineStats:
            with anyio.fail_after(timeout):
                return await self.engine.wait_until(predicate)

        return self.portal.call(wait)

    def wait_until_running(self, num_requests: int = 1, timeout: float = 60.0) -> EngineStats:
        """Return once ``num_requests`` requests run (the server has admitted them)."""
        return self.wait_until(lambda s: s.num_running >= num_requests, timeout)

    def wait_until_free(self, timeout: float = 60.0) -> EngineStats:
        """The stats once no request runs or waits and no page is held, the pool's books
        checked (:func:`~hybridkv.testing.wait_until_free`); raises
        :class:`~hybridkv.testing.LeakError` if pages stay held."""
        return self.portal.call(functools.partial(wait_until_free, self.engine, timeout=timeout))


@attrs.frozen(kw_only=True)
class _Setup:
    config: EngineConfig
    executor: Executor
    tokenizer: Any
    model: str
    options: ServerOptions
    chat_template: ChatTemplate
    limits: ConnectionLimits | None
    send_buffer: int | None
    wrap_app: Callable[[Any], Any] | None
    proposer: Any = None
    kv_events: Any = None
    offload: Any = None


async def _run(
    setup: _Setup, *, task_status: anyio.abc.TaskStatus[tuple[Engine, Any, Any, int]]
) -> None:
    sock = open_socket("127.0.0.1", 0)
    if setup.send_buffer is not None:  # accepted sockets inherit it (Linux)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, setup.send_buffer)
    port = bound_port(sock)
    async with Engine(
        setup.config,
        setup.executor,
        offload=setup.offload,
        proposer=setup.proposer,
        kv_events=setup.kv_events,
    ) as engine:
        app = build_app(
            engine,
            setup.tokenizer,
            model_name=setup.model,
            max_model_len=setup.config.max_model_len,
            chat_template=setup.chat_template,
            options=setup.options,
            kv_events=setup.kv_events,
        )
        served = app if setup.wrap_app is None else setup.wrap_app(app)
        async with anyio.create_task_group() as tg:
            if on_asyncio():
                serve = functools.partial(serve_http, limits=setup.limits)
                server = await tg.start(serve, served, sock)
            else:
                server = await tg.start(serve_hypercorn, served, sock)
            task_status.started((engine, app, server, port))


@contextlib.contextmanager
def live_server(
    config: EngineConfig,
    executor: Executor,
    *,
    tokenizer: Any,
    model: str = "fake-model",
    options: ServerOptions | None = None,
    chat_template: ChatTemplate | None = None,
    limits: ConnectionLimits | None = None,
    backend: Backend = "asyncio",
    portal: BlockingPortal | None = None,
    send_buffer: int | None = None,
    wrap_app: Callable[[Any], Any] | None = None,
    proposer: Any = None,
    kv_events: Any = None,
    offload: Any = None,
) -> Iterator[LiveServer]:
    """Serve ``executor`` under ``config`` on a loopback port until the block ends.

    Args:
        config: The engine's config (``EngineConfig.for_executor`` or its own).
        executor: A fake executor (``hybridkv.testing``) or a model's.
        tokenizer: A ``tokenizers.Tokenizer`` (``word_tokenizer()``, ``byte_tokenizer()``).
        model: The name clients ask for.
        options: The app's request limits and defaults.
        chat_template: The chat template (default: each message's content on a line).
        limits: Connection limits (uvicorn's, so asyncio only).
        backend: The server loop's: ``asyncio`` (``serve_http``) or ``trio``
            (``serve_hypercorn``; needs ``hybridkv[trio]``).
        portal: Run in this portal's loop instead of a new thread (several servers).
        send_buffer: The accepted sockets' send buffer, in bytes (tests of slow readers).
        wrap_app: ASGI middleware to serve around the app (``wrap_app(app)``): a test
            can watch a request's body being read, or its handler returning.
        proposer: With ``config.speculative_config``, what proposes tokens
            (:class:`~hybridkv.testing.ReferenceProposer` for the fakes).
        kv_events: The engine's KV event publisher (``KVEventPublisher``), described at
            ``GET /kv_events``.
        offload: The engine's offload tiers (an ``OffloadConfig``).

    Raises:
        ValueError: ``limits`` with the trio backend, which cannot apply them.
    """
    if limits is not None and backend == "trio":
        raise ValueError("connection limits are uvicorn's (asyncio); hypercorn serves trio")
    setup = _Setup(
        config=config,
        executor=executor,
        tokenizer=tokenizer,
        model=model,
        options=options or ServerOptions(),
        chat_template=chat_template or ChatTemplate.plain(),
        limits=limits,
        send_buffer=send_buffer,
        wrap_app=wrap_app,
        proposer=proposer,
        kv_events=kv_events,
        offload=offload,
    )
    with contextlib.ExitStack() as stack:
        if portal is None:
            portal = stack.enter_context(start_blocking_portal(backend))
        future, (engine, app, server, port) = portal.start_task(_run, setup)
        try:
            url = f"http://127.0.0.1:{port}"
            yield LiveServer(url, model, engine, app, executor, portal, server)
        finally:
            portal.call(setattr, server, "should_exit", True)
            future.result(timeout=30)
