"""Connections that cannot hold the server: a cap on their number that a flood of idle
sockets cannot fill, and timeouts for the parts of HTTP that uvicorn leaves unbounded.

uvicorn closes a kept-alive connection after ``timeout_keep_alive`` of silence between
requests, and nothing else: a client that connects and sends nothing, or half a request
head, or stops reading a response, held its socket forever (260 stalled clients under a
200-descriptor limit made the server unreachable). This protocol adds::

    connected, nothing sent yet             first_byte_timeout_s -> closed
    connected, no full request head yet     head_timeout_s       -> closed
    response paused: client not reading     write_timeout_s      -> closed (aborts the
                                                                     request, like a disconnect)
    max_connections open, one more comes    the OLDEST connection that has not sent a
                                            full request (head and body) is closed, and
                                            the new one kept
    ... and every open one has a request    the new one is kept in a small reserve
                                            (monitoring_reserve) that answers only
                                            /health and /metrics (others: a 503)
    ... and the reserve is full too         the new one is closed at once
    max_connections_per_client from one     the next from that address is closed at once
    address (off by default)

Closing the oldest waiting connection rather than the newest is what keeps the server
open to fresh clients: a process that holds every slot with idle sockets, and reopens
each one the server closes, only ever pushes its own oldest sockets out, while a fresh
client, whose request head follows its connection at once, is the newest and is served.

The request body's own timeout is the app's (a 408, ``bodies.py``). A connection closed
here looks to the app like the client disconnecting, which it logs once at info level.
The lines logged here come at most once a second per kind (:class:`RateLimitedLog`), with
the count of those left out, so that a flood cannot fill the disk with them.

The protocol is uvicorn's httptools one (llhttp, uvicorn's default) with these timers,
and a cap on the request head that llhttp lacks (h11's 16 KiB: a 431 beyond); uvicorn's
protocol classes are asyncio-native, so the timers are the loop's ``call_later`` handles,
as uvicorn's own.
One :class:`ConnectionTable` per server (one per :meth:`ConnectionLimits.protocol` call)
counts the connections and keeps those waiting for a request in the order they began
to wait.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from hybridkv.errors.events import get_logger
from hybridkv.serving.http.rate_limited_log import RateLimitedLog
from hybridkv.serving.openai.errors import error_body

log = get_logger(__name__)

#: The paths a connection of the monitoring reserve answers.
MONITORING_PATHS = frozenset({"/health", "/metrics"})

#: Descriptors left to the engine's own files (the listening socket, the loop's, the
#: grammar checker's pipes, log files, a GPU driver's device files, offload files) when
#: the connection cap is fitted to the process's descriptor limit.
DESCRIPTOR_HEADROOM = 64

#: The most bytes of one request head (its line and headers; h11's and Node's cap).
MAX_HEAD_BYTES = 16 * 1024

# Where a connection's request is: no full head yet, its body coming, all of it in.
_HEAD, _BODY, _SERVED = "head", "body", "served"


@attrs.frozen(kw_only=True)
class ConnectionLimits:
    """Limits of the connections one server keeps.

    Attributes:
        max_connections: Open connections at once. One more evicts the oldest that has
            not sent a full request; with none such it goes to the monitoring reserve.
        max_connections_per_client: Open connections from one peer address at once
            (None: no limit; behind a proxy every client has the proxy's address).
        monitoring_reserve: Connections over ``max_connections`` kept for ``/health``
            and ``/metrics`` when every other connection has a request running.
        first_byte_timeout_s: From connecting to the first byte of a request.
        idle_timeout_s: Silence between two requests of a kept-alive connection.
        head_timeout_s: From connecting (or the end of the previous response) to a
            complete request head.
        write_timeout_s: How long a client may leave a response unread while the
            server has more to send.
    """

    max_connections: int = attrs.field(default=1000, validator=attrs.validators.ge(1))
    max_connections_per_client: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(1))
    )
    monitoring_reserve: int = attrs.field(default=8, validator=attrs.validators.ge(0))
    first_byte_timeout_s: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    idle_timeout_s: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    head_timeout_s: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))
    write_timeout_s: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))

    def protocol(self) -> Any:
        """The protocol factory to give uvicorn as ``http=`` (one per server: its
        connections share one :class:`ConnectionTable`)."""
        return functools.partial(LimitedHttpProtocol, table=ConnectionTable(self))

    def fit_descriptor_limit(self, *, headroom: int = DESCRIPTOR_HEADROOM) -> ConnectionLimits:
        """These limits, with ``max_connections`` lowered to fit the process's limit of
        open files (``RLIMIT_NOFILE``), ``headroom`` left to the engine's own files.

        The soft limit is raised first, as far as the hard limit allows; what was done
        is logged in one line (nothing when the limit already fits). Past the limit,
        ``accept()`` fails (EMFILE) and the server can neither take nor refuse anyone.
        """
        if sys.platform == "win32":  # no RLIMIT_NOFILE; sockets are not files there
            return self
        import resource

        unlimited = resource.RLIM_INFINITY
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = self.max_connections + self.monitoring_reserve + headroom
        if soft == unlimited or soft >= wanted:
            return self
        raised_from = None
        target = wanted if hard == unlimited else min(wanted, hard)
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            except (OSError, ValueError):
                pass
            else:
                raised_from, soft = soft, target
        if soft >= wanted:
            log.info("descriptor_limit_raised", descriptor_limit=soft, was=raised_from)
            return self
        fitting = max(1, soft - headroom - self.monitoring_reserve)
        log.warning(
            "max_connections_clamped",
            requested=self.max_connections,
            max_connections=fitting,
            descriptor_limit=soft,
            hard_limit=None if hard == unlimited else hard,
            raised_from=raised_from,
            headroom=headroom,
            monitoring_reserve=self.monitoring_reserve,
        )
        return attrs.evolve(self, max_connections=fitting)


class ConnectionTable:
    """The connections of one server: how many are open, how many from each peer
    address, and which wait for a request, oldest first (a dict keeps insertion order:
    a connection is put back at the end when it begins to wait again)."""

    def __init__(
        self, limits: ConnectionLimits, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits
        self.clock = clock
        self.open = 0
        self.per_client: Counter[str] = Counter()
        self.waiting: dict[LimitedHttpProtocol, None] = {}
        self._logs: dict[str, RateLimitedLog] = {}

    def admit(self, conn: LimitedHttpProtocol) -> bool:
        """Count a new connection in, evicting the oldest waiting one at the cap; False:
        refuse it (the caller closes it)."""
        limits = self.limits
        peer = conn.peer
        per_client = limits.max_connections_per_client
        if per_client is not None and peer is not None and self.per_client[peer] >= per_client:
            reason = "max_connections_per_client"
            self.log("connection_refused", reason=reason, limit=per_client, client=peer)
            return False
        if self.open >= limits.max_connections:
            victim = next(iter(self.waiting), None)
            if victim is not None:
                cap = limits.max_connections
                self.log("connection_evicted", max_connections=cap, client=victim.client)
                victim.evict()
        if self.open >= limits.max_connections + limits.monitoring_reserve:
            cap = limits.max_connections
            self.log("connection_refused", reason="max_connections", limit=cap, client=peer)
            return False
        # Over the cap still (every other connection has a request, or the one pushed
        # out was in the reserve): this one is in the reserve.
        conn.reserved = self.open >= limits.max_connections
        self.open += 1
        if peer is not None:
            self.per_client[peer] += 1
        self.waiting[conn] = None
        return True

    def release(self, conn: LimitedHttpProtocol) -> None:
        """Count a connection out (it is closing); once per admitted connection."""
        self.waiting.pop(conn, None)
        self.open -= 1
        if conn.peer is not None:
            self.per_client[conn.peer] -= 1
            if not self.per_client[conn.peer]:
                del self.per_client[conn.peer]

    def has_room(self) -> bool:
        """Whether the open connections fit ``max_connections`` (none uses the reserve)."""
        return self.open <= self.limits.max_connections

    def log(self, event: str, *, level: str = "warning", **fields: Any) -> None:
        """Log ``event`` at most once a second (:class:`RateLimitedLog`)."""
        limiter = self._logs.get(event)
        if limiter is None:
            limiter = self._logs[event] = RateLimitedLog(event, level)
        limiter(self.clock(), **fields)


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with :class:`ConnectionLimits`, and a cap on a
    request head (:data:`MAX_HEAD_BYTES`: a 431 and the connection closed beyond)."""

    def __init__(self, *args: Any, table: ConnectionTable, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.table = table
        self.limits = table.limits
        self.peer: str | None = None
        self.reserved = False  # admitted to the monitoring reserve
        self._counted = False
        self._request = _HEAD
        self._head_bytes = 0  # of the head being received
        self._began = False  # a request began in the read being parsed
        self._ended = False  # ... and one ended in it
        self._first_byte_timer: asyncio.TimerHandle | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.peer = self.client[0] if self.client else None
        if not self.table.admit(self):
            transport.abort()
            return
        self._counted = True
        if self.reserved:
            self.app = functools.partial(_monitoring_only, self, self.app)
        timeout = self.limits.first_byte_timeout_s
        self._first_byte_timer = self.loop.call_later(timeout, self._close, "first_byte_timeout")
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        self._cancel("_first_byte_timer")
        self._began = self._ended = False
        super().data_received(data)
        if self._request is _HEAD and not self.transport.is_closing():
            # Bytes of a head came, not all of it: all this read's, unless the read
            # ended a request before it (then it counts from the next read on, and the
            # cap is passed by one read at most).
            if self._began:
                self._head_bytes = 0
            self._head_bytes += 0 if self._ended else len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse_head()
                return
            self._arm_head_timer()
        else:
            self._cancel("_head_timer")
        if self._request is _SERVED:
            self.table.waiting.pop(self, None)  # a full request: it is served, not evicted

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._request = _HEAD
        self._began = True

    def on_headers_complete(self) -> None:
        self._request = _BODY
        self._head_bytes = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._request = _SERVED
        self._ended = True
        super().on_message_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # a next request came whole already
        super().on_response_complete()
        if not self._counted or self.transport.is_closing():
            return
        if self._request is _SERVED and not pipelined:
            self._request = _HEAD  # the one answered: the next has not begun
        if self._request is not _SERVED:
            # Kept alive for another request: it waits again, as the newest.
            self.table.waiting.pop(self, None)
            self.table.waiting[self] = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._uncount()
        self._cancel("_first_byte_timer")
        self._cancel("_head_timer")
        self._cancel("_write_timer")
        super().connection_lost(exc)

    def evict(self) -> None:
        """Close this connection to make room for a new one."""
        self._uncount()
        self.transport.abort()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            timeout = self.limits.write_timeout_s
            self._write_timer = self.loop.call_later(timeout, self._close, "client_not_reading")

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel("_write_timer")

    def _refuse_head(self) -> None:
        """A 431 for a head over the cap, and the connection closed."""
        self.table.log("request_head_too_large", level="info", client=self.client)
        message = f"the request head is over {MAX_HEAD_BYTES} bytes".encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%b" % (len(message), message)
        )
        self.transport.close()
        self._cancel("_head_timer")

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self.table.release(self)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            timeout = self.limits.head_timeout_s
            self._head_timer = self.loop.call_later(timeout, self._head_expired)

    def _head_expired(self) -> None:
        self._head_timer = None
        if self._request is _HEAD:
            self._close("request_head_timeout")

    def _close(self, event: str) -> None:
        if not self.transport.is_closing():
            self.table.log(event, level="info", client=self.client)
            self.transport.abort()

    def _cancel(self, name: str) -> None:
        timer = getattr(self, name)
        if timer is not None:
            timer.cancel()
            setattr(self, name, None)


async def _monitoring_only(
    conn: LimitedHttpProtocol, app: Any, scope: Any, receive: Any, send: Any
) -> None:
    """The app of a connection in the monitoring reserve: /health and /metrics, and any
    path once the connection fits under the cap again; a 503 that closes it otherwise."""
    if conn.table.has_room():
        conn.reserved = False
    if not conn.reserved or scope.get("path") in MONITORING_PATHS:
        await app(scope, receive, send)
        return
    limit = conn.limits.max_connections
    message = (
        f"the server is at its connection limit ({limit}); only /health and /metrics are "
        "answered on this connection, retry on a new one"
    )
    error = error_body(message, "server_overloaded", code="connection_limit")
    body = json.dumps(error, separators=(",", ":")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        (b"retry-after", b"1"),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})
