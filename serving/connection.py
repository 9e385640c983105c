"""Connections that cannot hold the server: a cap on their number, and timeouts for the
parts of HTTP that uvicorn leaves unbounded.

uvicorn closes a kept-alive connection after ``timeout_keep_alive`` of silence between
requests, and nothing else: a client that connects and sends nothing, or half a request
head, or stops reading a response, held its socket forever (260 stalled clients under a
200-descriptor limit made the server unreachable). This protocol adds::

    connected, no full request head yet     head_timeout_s    -> closed
    response paused: client not reading     write_timeout_s   -> closed (aborts the
                                                                  request, like a disconnect)
    more than max_connections open          the newest is closed at once

The request body's own timeout is the app's (a 408, ``body.py``). A connection closed
here looks to the app like the client disconnecting, which it logs once at info level.

The protocol is uvicorn's h11 one with these timers; uvicorn's protocol classes are
asyncio-native, so the timers are the loop's ``call_later`` handles, as uvicorn's own.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import attrs
import h11
import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

log = structlog.get_logger(__name__)


@attrs.frozen(kw_only=True)
class ConnectionLimits:
    """Limits of the connections one server keeps.

    Attributes:
        max_connections: Open connections at once; more are closed as they arrive.
        idle_timeout_s: Silence between two requests of a kept-alive connection.
        head_timeout_s: From connecting (or the end of the previous response) to a
            complete request head.
        write_timeout_s: How long a client may leave a response unread while the
            server has more to send.
    """

    max_connections: int = attrs.field(default=1000, validator=attrs.validators.ge(1))
    idle_timeout_s: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    head_timeout_s: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    write_timeout_s: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))

    def protocol(self) -> Any:
        """The protocol factory to give uvicorn as ``http=``."""
        return functools.partial(LimitedH11Protocol, limits=self)


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with :class:`ConnectionLimits`."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._head_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            log.warning("connection_refused", max_connections=self.limits.max_connections)
            transport.abort()
            return
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm_head_timer()  # bytes of a head came, not all of it
        else:
            self._cancel("_head_timer")

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel("_head_timer")
        self._cancel("_write_timer")
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            timeout = self.limits.write_timeout_s
            self._write_timer = self.loop.call_later(timeout, self._close, "client_not_reading")

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel("_write_timer")

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            timeout = self.limits.head_timeout_s
            self._head_timer = self.loop.call_later(timeout, self._head_expired)

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE:
            self._close("request_head_timeout")

    def _close(self, event: str) -> None:
        if not self.transport.is_closing():
            log.info(event, client=self.client)
            self.transport.abort()

    def _cancel(self, name: str) -> None:
        timer = getattr(self, name)
        if timer is not None:
            timer.cancel()
            setattr(self, name, None)
