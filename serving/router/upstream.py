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
asyncio only (``--loop``), and anyio's socket stream, with a cancel scope around each
read for that bound, took the front end's CPU per request from 1.41-1.50x smg's to
1.62x (``python -m benchmarks.routing.front_end_overhead --concurrency 8 --max-tokens
16``, in turns).

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
import select
import ssl
import time
from collections.abc import AsyncIterator, Sequence
from typing import cast
from urllib.parse import urlsplit

import anyio
import httptools

#: Seconds an idle connection is kept: under the replicas' keep-alive (uvicorn's 5 s),
#: so that the pool seldom holds one the replica is about to close.
_IDLE_S = 4.0
#: Body bytes waiting for the reader past which the connection stops reading.
_HIGH_WATER = 65_536


class UpstreamError(Exception):
    """A try that failed: the connection broke, or the answer was not HTTP."""


class UpstreamConnectError(UpstreamError):
    """No connection could be made to the replica (refused, unreachable or timed out)."""


class _Unanswered(UpstreamError):
    """The connection failed before one byte of an answer came: on a kept connection,
    the replica closed it as it went idle and never read the request (tried again on a
    new one)."""


class _Connection(asyncio.Protocol):
    """One kept-alive connection: what arrives is parsed at once into the answer being
    read, and the reader, waiting in :meth:`wait`, is woken."""

    def __init__(self, key: tuple[str, int, bool]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.answer: _Parsing | None = None
        self.ended = False  # the replica closed it (or it broke)
        self.error: BaseException | None = None  # why it broke
        self.idle_since = 0.0
        self._waiter: asyncio.Future[bool] | None = None
        self._drained: asyncio.Future[None] | None = None
        self._paused = False

    # -- the protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        answer = self.answer
        if answer is None:  # bytes while idle: not an answer to anything; unusable
            self.ended = True
            self.close()
            return
        answer.received = True
        try:
            answer.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            answer.error = UpstreamError(f"a malformed answer: {exc}")
        if answer.waiting_bytes() > _HIGH_WATER and self.transport is not None:
            self._paused = True  # resumed as the reader takes them
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.ended = True
        self._wake()
        return False  # close it

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self.error = exc
        self._wake()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def pause_writing(self) -> None:
        self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    # -- for the reader ---------------------------------------------------------------

    async def write(self, data: bytes, timeout_s: float | None) -> None:
        """Write ``data``, waiting up to ``timeout_s`` while the replica does not read
        it (a TimeoutError beyond); an OSError if the connection breaks first."""
        assert self.transport is not None
        if not self.ended:
            self.transport.write(data)
            if self._drained is not None:
                with anyio.fail_after(timeout_s):
                    await self._drained
        if self.ended and self.error is not None:
            raise self.error if isinstance(self.error, OSError) else OSError(str(self.error))

    async def wait(self, timeout_s: float | None = None) -> bool:
        """Until bytes come or the connection ends (True), or ``timeout_s`` passes."""
        if self.ended:
            return True
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        # A timer, not a cancel scope: this runs once per relayed event.
        timer = None if timeout_s is None else loop.call_later(timeout_s, _expire, waiter)
        try:
            return bool(await waiter)
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def is_open(self) -> bool:
        """Whether the replica has not closed it while it was idle (a peek, no read)."""
        if self.ended or time.monotonic() - self.idle_since > _IDLE_S:
            return False
        sock = None if self.transport is None else self.transport.get_extra_info("socket")
        if sock is None or not hasattr(select, "poll"):
            return True  # trust the idle bound
        poll = select.poll()
        poll.register(sock.fileno(), select.POLLIN)
        return not poll.poll(0)  # readable while idle: closed by the replica (or stray bytes)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(True)


class UpstreamAnswer:
    """A replica's answer, its head read (see the module docstring).

    Attributes:
        status_code: Its HTTP status.
        headers: Its headers, names in lower case (a repeated one: the last).
    """

    def __init__(self, pool: UpstreamPool, connection: _Connection, parsing: _Parsing) -> None:
        self._pool = pool
        self._connection: _Connection | None = connection
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


class _Parsing:
    """One answer's parser state: httptools' callbacks fill in its status, headers and
    body pieces as the connection's bytes arrive."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.head_done = False
        self.body: list[bytes] = []
        self.done = False
        self.received = False  # a byte of the answer came
        self.error: UpstreamError | None = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.head_done = True
        # Asked now: llhttp forgets it once the message is complete.
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True

    def waiting_bytes(self) -> int:
        return sum(map(len, self.body))

    def keeps_alive(self, connection: _Connection) -> bool:
        return self.done and not connection.ended and self.keep_alive

    def check(self, connection: _Connection) -> None:
        """Raise what ended the answer before its end, if anything did: a malformed
        answer, or the connection broken or closed (a body without framing ends with it:
        then :attr:`done`)."""
        if self.error is not None:
            raise self.error
        if not connection.ended:
            return
        if self.head_done and not self._framed():
            self.done = True  # a body that ends where the connection does
            return
        exc = connection.error
        if not self.received:
            reason = (
                _describe(exc) if exc else "the replica closed the connection without answering"
            )
            raise _Unanswered(reason) from exc
        if exc is not None:
            raise UpstreamError(_describe(exc)) from exc
        raise UpstreamError("the replica closed the connection mid-answer")

    def _framed(self) -> bool:
        names = {name for name, _ in self.headers}
        return b"content-length" in names or b"transfer-encoding" in names


class UpstreamPool:
    """Kept-alive connections to the replicas, per host.

    Args:
        connect_timeout_s: The longest wait for a new connection.
        max_idle: Most idle connections kept per replica.
    """

    def __init__(self, *, connect_timeout_s: float = 10.0, max_idle: int = 64) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
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
            with contextlib.suppress(_Unanswered):
                return await self._exchange(kept, request, write_timeout_s)
        try:
            return await self._exchange(await self._connect(key), request, write_timeout_s)
        except _Unanswered as exc:
            raise UpstreamError(str(exc)) from exc.__cause__

    async def _exchange(
        self, connection: _Connection, request: bytes, write_timeout_s: float | None
    ) -> UpstreamAnswer:
        """Write ``request`` on ``connection`` and read the answer's head; an
        :class:`_Unanswered` where not one byte of an answer came."""
        parsing = connection.answer = _Parsing()
        try:
            try:
                await connection.write(request, write_timeout_s)
            except OSError as exc:
                if not parsing.head_done:  # else: it answered, refusing the rest (a 413)
                    if parsing.received:
                        raise UpstreamError(_describe(exc)) from exc
                    raise _Unanswered(f"sending the request: {_describe(exc)}") from exc
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

    def put(self, connection: _Connection) -> None:
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

    def _take(self, key: tuple[str, int, bool]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            if connection.is_open():
                return connection
            connection.close()
        return None

    async def _connect(self, key: tuple[str, int, bool]) -> _Connection:
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
                    lambda: _Connection(key), host, port, ssl=context
                )
        except TimeoutError:
            raise UpstreamConnectError(
                f"cannot connect: no connection in {self.connect_timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect: {exc}") from exc
        return connection


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".rstrip(": ")


__all__ = ["UpstreamAnswer", "UpstreamConnectError", "UpstreamError", "UpstreamPool"]
