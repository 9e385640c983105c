"""One kept-alive connection of the front end to a replica (``upstream.py`` pools them):
an asyncio protocol that parses what arrives as it arrives, into the answer being read,
and wakes its reader with one future."""

from __future__ import annotations

import asyncio
import select
import time
from typing import cast

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


class Unanswered(UpstreamError):
    """The connection failed before one byte of an answer came: on a kept connection,
    the replica closed it as it went idle and never read the request (tried again on a
    new one)."""


class Connection(asyncio.Protocol):
    """One kept-alive connection: what arrives is parsed at once into the answer being
    read, and the reader, waiting in :meth:`wait`, is woken."""

    def __init__(self, key: tuple[str, int, bool]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.answer: Parsing | None = None
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


class Parsing:
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

    def keeps_alive(self, connection: Connection) -> bool:
        return self.done and not connection.ended and self.keep_alive

    def check(self, connection: Connection) -> None:
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
            reason = describe(exc) if exc else "the replica closed the connection without answering"
            raise Unanswered(reason) from exc
        if exc is not None:
            raise UpstreamError(describe(exc)) from exc
        raise UpstreamError("the replica closed the connection mid-answer")

    def _framed(self) -> bool:
        names = {name for name, _ in self.headers}
        return b"content-length" in names or b"transfer-encoding" in names


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".rstrip(": ")


__all__ = [
    "Connection",
    "Parsing",
    "Unanswered",
    "UpstreamConnectError",
    "UpstreamError",
    "describe",
]
