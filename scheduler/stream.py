"""The consumer side of a request: its output channel and the async iterator over it.

One engine step delivers one output to every running request, so this is the hottest
path after planning: the channel is a deque plus an event made only when the consumer
has to wait (a third of the cost of an anyio memory object stream per item)::

    engine (loop thread)  --send_nowait/close-->  OutputChannel  --get-->  RequestStream
                                                                           (async for)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import anyio

from hybridkv.errors import HybridKVError
from hybridkv.scheduler.outputs import RequestOutput
from hybridkv.scheduler.request import Request

_Item = RequestOutput | HybridKVError


class OutputChannel:
    """An unbounded single-consumer channel; every method runs on the loop's thread.

    The engine never waits on it (a slow consumer only buffers). After :meth:`close`,
    the consumer drains what is buffered and then sees the end.
    """

    __slots__ = ("_event", "_is_closed", "_items")

    def __init__(self) -> None:
        self._items: deque[_Item] = deque()
        self._event: anyio.Event | None = None
        self._is_closed = False

    def send_nowait(self, item: _Item) -> None:
        """Buffer one item and wake the consumer if it waits."""
        if self._is_closed:
            raise anyio.ClosedResourceError
        self._items.append(item)
        self._wake()

    def close(self) -> None:
        """No item follows; a waiting consumer wakes up to the end."""
        self._is_closed = True
        self._wake()

    async def get(self) -> _Item:
        """The next item; raises ``anyio.EndOfStream`` once closed and drained."""
        items = self._items
        while not items:
            if self._is_closed:
                raise anyio.EndOfStream
            event = self._event = anyio.Event()
            await event.wait()
        return items.popleft()

    def _wake(self) -> None:
        event = self._event
        if event is not None:
            self._event = None
            event.set()


class RequestStream:
    """The async iterator of one request's outputs; closing or dropping it aborts.

    The last output has ``finish_reason`` set. A failure of the request is raised by the
    iterator. Leaving early (``break``, cancellation, ``aclose()``, the object being
    dropped) aborts the request at once; its pages are freed at once, or right after
    the step in flight if it is part of it.
    """

    __slots__ = ("_abort", "_channel", "_is_done", "_request")

    def __init__(
        self, request: Request, channel: OutputChannel, abort: Callable[[Request, bool], None]
    ) -> None:
        self._request = request
        self._channel = channel
        self._abort = abort
        self._is_done = False

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self._request.request_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._is_done:
            raise StopAsyncIteration
        try:
            item = await self._channel.get()
        except anyio.EndOfStream:
            self._is_done = True
            raise StopAsyncIteration from None
        except BaseException:  # cancelled while waiting: the consumer is gone
            self.close()
            raise
        if isinstance(item, BaseException):
            self._is_done = True
            raise item
        if item.finish_reason is not None:
            self._is_done = True
        return item

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    async def aclose(self) -> None:
        """Abort the request if it has not finished (same as :meth:`close`)."""
        self.close()

    def close(self) -> None:
        """Abort the request if it has not finished."""
        if not self._is_done:
            self._is_done = True
            self._abort(self._request, False)

    def __del__(self) -> None:
        # A finalizer can run anywhere, even inside the engine's planning (a GC pass on
        # the loop thread): it only queues the abort, never changes the engine's state.
        if not self._is_done:
            self._is_done = True
            self._abort(self._request, True)
