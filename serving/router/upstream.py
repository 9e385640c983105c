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
and 0.42-0.48 through this client, which does what a forward needs and no more.

Failures are :class:`UpstreamError`; a connection that could not be made at all is
:class:`UpstreamConnectError` (the replica is not there). A replica that refuses a body
while it is still being written (a 413 from a limit lower than the front end's) resets
the connection, and its answer is lost with it (measured: 0 of 20 such answers could be
read after the failed write): the front end applies the replicas' limits itself.
"""

from __future__ import annotations

import contextlib
import math
import select
import ssl
import time
from collections.abc import AsyncIterator, Sequence
from urllib.parse import urlsplit

import anyio
import anyio.abc
import httptools

#: Seconds an idle connection is kept: under the replicas' keep-alive (uvicorn's 5 s),
#: so that the pool seldom holds one the replica is about to close.
_IDLE_S = 4.0
_READ_SIZE = 65_536


class UpstreamError(Exception):
    """A try that failed: the connection broke, or the answer was not HTTP."""


class UpstreamConnectError(UpstreamError):
    """No connection could be made to the replica (refused, unreachable or timed out)."""


class _Unanswered(UpstreamError):
    """The connection failed before one byte of an answer came: on a kept connection,
    the replica closed it as it went idle and never read the request (tried again on a
    new one)."""


class _Head:
    """httptools' callbacks: the answer's status, headers and body pieces so far."""

    def __init__(self) -> None:
        self.parser: httptools.HttpResponseParser | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.head_done = False
        self.body: list[bytes] = []
        self.done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.head_done = True
        # Asked now: llhttp forgets it once the message is complete.
        self.keep_alive = self.parser is not None and self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True


class _Connection:
    def __init__(self, key: tuple[str, int, bool], stream: anyio.abc.ByteStream) -> None:
        self.key = key
        self.stream = stream
        self.idle_since = 0.0

    def is_open(self) -> bool:
        """Whether the replica has not closed it while it was idle (a peek, no read)."""
        if time.monotonic() - self.idle_since > _IDLE_S:
            return False
        raw = self.stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
        if raw is None or not hasattr(select, "poll"):
            return True  # trust the idle bound
        poll = select.poll()
        poll.register(raw.fileno(), select.POLLIN)
        return not poll.poll(0)  # readable while idle: closed by the replica (or stray bytes)

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.stream.aclose()


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
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in parsing.head.headers}

    async def chunks(self, stall_s: float | None = None) -> AsyncIterator[bytes]:
        """The body as it arrives; ``stall_s``: the longest wait for the next bytes (an
        :class:`UpstreamError` beyond)."""
        parsing = self._parsing
        while True:
            if parsing.head.body:
                piece = b"".join(parsing.head.body)
                parsing.head.body.clear()
                yield piece
            if parsing.finished:
                return
            if self._connection is None:
                raise UpstreamError("the answer was closed before its end")
            # A scope of its own, not fail_after: this runs once per relayed event.
            with anyio.CancelScope(deadline=_deadline(stall_s)) as waited:
                await parsing.receive(self._connection.stream)
            if waited.cancelled_caught:
                raise UpstreamError(f"no byte within {stall_s:g} s")

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([piece async for piece in self.chunks()])

    async def aclose(self) -> None:
        """Done with it: its connection goes back to the pool, or is closed."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if self._parsing.keeps_alive():  # read whole, and the replica keeps it open
            await self._pool.put(connection)
        else:
            await connection.close()


class _Parsing:
    """One answer's parser over one connection's bytes."""

    def __init__(self) -> None:
        self.head = _Head()
        self.parser = httptools.HttpResponseParser(self.head)
        self.head.parser = self.parser
        self.ended = False  # the replica closed the connection
        self.received = False  # a byte of the answer came

    @property
    def finished(self) -> bool:
        return self.head.done or self.ended

    def keeps_alive(self) -> bool:
        return self.head.done and not self.ended and self.head.keep_alive

    async def receive(self, stream: anyio.abc.ByteStream) -> None:
        """Read once and parse what came; an :class:`UpstreamError` if the connection
        broke or closed before the answer's end."""
        try:
            data = await stream.receive(_READ_SIZE)
        except anyio.EndOfStream:
            self.ended = True
            if self.head.head_done and not self._framed():
                return  # a body that ends where the connection does
            if not self.received:
                raise _Unanswered("the replica closed the connection without answering") from None
            raise UpstreamError("the replica closed the connection mid-answer") from None
        except (OSError, anyio.BrokenResourceError) as exc:
            if not self.received:
                raise _Unanswered(_describe(exc)) from exc
            raise UpstreamError(_describe(exc)) from exc
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise UpstreamError(f"a malformed answer: {exc}") from exc

    def _framed(self) -> bool:
        names = {name for name, _ in self.head.headers}
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
        kept = await self._take(key)
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
        parsing = _Parsing()
        try:
            try:
                with anyio.fail_after(write_timeout_s):
                    await connection.stream.send(request)
            except (OSError, anyio.BrokenResourceError) as exc:
                raise _Unanswered(f"sending the request: {_describe(exc)}") from exc
            except TimeoutError:
                raise UpstreamError(f"the request was not sent in {write_timeout_s:g} s") from None
            while not parsing.head.head_done:
                await parsing.receive(connection.stream)
        except BaseException:
            await connection.close()
            raise
        return UpstreamAnswer(self, connection, parsing)

    async def put(self, connection: _Connection) -> None:
        """Keep ``connection`` for a later request (or close it: the pool is full)."""
        idle = self._idle.setdefault(connection.key, [])
        if len(idle) >= self.max_idle:
            await connection.close()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)

    async def aclose(self) -> None:
        """Close every idle connection."""
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                await connection.close()

    async def _take(self, key: tuple[str, int, bool]) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()
            if connection.is_open():
                return connection
            await connection.close()
        return None

    async def _connect(self, key: tuple[str, int, bool]) -> _Connection:
        host, port, tls = key
        try:
            with anyio.fail_after(self.connect_timeout_s):
                stream: anyio.abc.ByteStream
                if tls:
                    if self._tls is None:
                        self._tls = ssl.create_default_context()
                    stream = await anyio.connect_tcp(host, port, ssl_context=self._tls)
                else:
                    stream = await anyio.connect_tcp(host, port)
        except TimeoutError:
            raise UpstreamConnectError(
                f"cannot connect: no connection in {self.connect_timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect: {exc}") from exc
        return _Connection(key, stream)


def _deadline(seconds: float | None) -> float:
    return math.inf if seconds is None else anyio.current_time() + seconds


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".rstrip(": ")


__all__ = ["UpstreamAnswer", "UpstreamConnectError", "UpstreamError", "UpstreamPool"]
