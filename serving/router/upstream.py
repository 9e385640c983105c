"""The front end's connections to its replicas: kept-alive HTTP/1.1, read with
httptools' parser, with nothing between a replica's bytes and the client's stream.

::

    UpstreamPool.send(url, ...)  a kept connection to url's host that is still open
                                 (or a new one) -> write the request -> read the head
                                 -> UpstreamAnswer(status, headers)
    UpstreamAnswer.chunks()      the body as it arrives, chunked framing removed: what
                                 one read brought comes out as one piece
    UpstreamAnswer.aclose()      the connection back to the pool where the answer was
                                 read whole and the replica keeps it open; else closed

A forward is the front end's hot path: each streamed token of each request crosses it.
Under the routing workload (``python -m benchmarks.routing.policies --real``, its
``front_end_cpu_s``) the front end used 0.56-0.58 CPU seconds forwarding through httpx,
whose pool bookkeeping, socket checks and wrappers per read were a third of its profile,
and 0.42-0.48 through this client, which does what a forward needs and no more. Each
connection is an asyncio protocol that parses what arrives as it arrives, and wakes the
reader with one future (the stall bound is a timer on it): the front end runs on
asyncio only (``--loop``). With anyio's socket stream and a cancel scope around each
read for that bound, the front end's CPU per request was 1.62x smg's; with these
protocols, 1.41-1.50x (``python -m benchmarks.routing.front_end_overhead --concurrency 8
--max-tokens 16``, in turns).

Failures are :class:`UpstreamError`; a connection that could not be made at all is
:class:`UpstreamConnectError` (the replica is not there). A replica that refuses a body
while it is still being written (a 413 from a limit lower than the front end's) resets
the connection, and its answer is lost with it unless its head was read before the reset
(with the stream client before these protocols, 0 of 20 such answers could be read after
the failed write): the front end applies the replicas' limits itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator, Sequence
from urllib.parse import urlsplit

import anyio

from hybridkv.serving.router.upstream_connection import (
    Connection,
    Parsing,
    Unanswered,
    UpstreamConnectError,
    UpstreamError,
    describe,
)


class UpstreamAnswer:
    """A replica's answer, its head read (see the module docstring).

    Attributes:
        status_code: Its HTTP status.
        headers: Its headers, names in lower case (a repeated one: the last).
    """

    def __init__(self, pool: UpstreamPool, connection: Connection, parsing: Parsing) -> None:
        self._pool = pool
        self._connection: Connection | None = connection
        self._parsing = parsing
        self.status_code = parsing.parser.get_status_code()
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in parsing.headers}

    async def chunks(self, stall_s: float | None = None) -> AsyncIterator[bytes]:
        """The body as it arrives; ``stall_s``: the longest wait for the next bytes (an
        :class:`UpstreamError` beyond)."""
        parsing = self._parsing
        while True:
            if parsing.body:
                piece = b"".join(parsing.body)
                parsing.body.clear()
                yield piece
            if parsing.done:
                return
            connection = self._connection
            if connection is None:
                raise UpstreamError("the answer was closed before its end")
            parsing.check(connection)
            if not await connection.wait(stall_s):
                raise UpstreamError(f"no byte within {stall_s:g} s")

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([piece async for piece in self.chunks()])

    async def aclose(self) -> None:
        """Done with it: its connection goes back to the pool, or is closed."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        connection.answer = None
        if self._parsing.keeps_alive(connection):  # read whole, and the replica keeps it open
            self._pool.put(connection)
        else:
            connection.close()


class UpstreamPool:
    """Kept-alive connections to the replicas, per host.

    Args:
        connect_timeout_s: The longest wait for a new connection.
        max_idle: Most idle connections kept per replica.
    """

    def __init__(self, *, connect_timeout_s: float = 10.0, max_idle: int = 64) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self._idle: dict[tuple[str, int, bool], list[Connection]] = {}
        self._tls: ssl.SSLContext | None = None

    async def send(
        self,
        url: str,
        method: str,
        headers: Sequence[tuple[str, str]],
        body: bytes,
        *,
        write_timeout_s: float | None = None,
    ) -> UpstreamAnswer:
        """Send a request to ``url`` and read its answer's head."""
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        host = parts.hostname or "127.0.0.1"
        key = (host, parts.port or (443 if tls else 80), tls)
        target = parts.path or "/"
        if parts.query:
            target = f"{target}?{parts.query}"
        lines = [f"{method} {target} HTTP/1.1", f"host: {parts.netloc}"]
        lines += [f"{name}: {value}" for name, value in headers]
        if body or method not in ("GET", "HEAD"):
            lines.append(f"content-length: {len(body)}")
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
        kept = self._take(key)
        if kept is not None:
            # Unanswered, the replica closed it as it went idle: it never read the request.
            with contextlib.suppress(Unanswered):
                return await self._exchange(kept, request, write_timeout_s)
        try:
            return await self._exchange(await self._connect(key), request, write_timeout_s)
        except Unanswered as exc:
            raise UpstreamError(str(exc)) from exc.__cause__

    async def _exchange(
        self, connection: Connection, request: bytes, write_timeout_s: float | None
    ) -> UpstreamAnswer:
        """Write ``request`` on ``connection`` and read the answer's head; an
        :class:`Unanswered` where not one byte of an answer came."""
        parsing = connection.answer = Parsing()
        try:
            try:
                await connection.write(request, write_timeout_s)
            except OSError as exc:
                if not parsing.head_done:  # else: it answered, refusing the rest (a 413)
                    if parsing.received:
                        raise UpstreamError(describe(exc)) from exc
                    raise Unanswered(f"sending the request: {describe(exc)}") from exc
            except TimeoutError:
                raise UpstreamError(f"the request was not sent in {write_timeout_s:g} s") from None
            while not parsing.head_done:
                parsing.check(connection)
                await connection.wait()
        except BaseException:
            connection.answer = None
            connection.close()
            raise
        return UpstreamAnswer(self, connection, parsing)

    def put(self, connection: Connection) -> None:
        """Keep ``connection`` for a later request (or close it: the pool is full)."""
        idle = self._idle.setdefault(connection.key, [])
        if len(idle) >= self.max_idle:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)

    async def aclose(self) -> None:
        """Close every idle connection."""
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()

    def _take(self, key: tuple[str, int, bool]) -> Connection | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            if connection.is_open():
                return connection
            connection.close()
        return None

    async def _connect(self, key: tuple[str, int, bool]) -> Connection:
        host, port, tls = key
        context = None
        if tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            context = self._tls
        loop = asyncio.get_running_loop()
        try:
            with anyio.fail_after(self.connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: Connection(key), host, port, ssl=context
                )
        except TimeoutError:
            raise UpstreamConnectError(
                f"cannot connect: no connection in {self.connect_timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect: {exc}") from exc
        return connection


__all__ = ["UpstreamAnswer", "UpstreamConnectError", "UpstreamError", "UpstreamPool"]
