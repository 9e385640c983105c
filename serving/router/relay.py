"""A forwarded request's watch on its client, and the stream the front end relays.

::

    Forwarder._until_gone   ClientWatch(receive): a task awaiting http.disconnect
                            -> cancels the forward's scope while it waits on a replica
    RelayedStream           the same watch, now cancelling the stream's scope, until the
                            stream ends (then Task.cancel stops it)
"""

from __future__ import annotations

import asyncio

import anyio
from starlette.types import Receive, Scope, Send

from hybridkv.serving.http.streaming import EventStreamResponse, until_disconnect


class ClientWatch:
    """Waits for the client's disconnect in a task of its own, and then cancels the scope
    its request runs in (:meth:`cancels`): the forward's first, then its stream's.

    One plain asyncio task for a whole forwarded request, stopped with ``Task.cancel``:
    the front end runs on asyncio only. With the two anyio task groups it replaces, one
    for the forward and one for the stream (whose cancel formats the task's repr), the
    front end's CPU per request was 1.81-1.93x smg's; with this watch, 1.64x (``python
    -m benchmarks.routing.front_end_overhead --concurrency 8 --max-tokens 16``, in turns).
    """

    def __init__(self, receive: Receive, path: str) -> None:
        self.gone = False
        self._scope: anyio.CancelScope | None = None
        self._task = asyncio.get_running_loop().create_task(self._watch(receive, path))

    def cancels(self, scope: anyio.CancelScope) -> None:
        """Cancel ``scope`` when the client leaves (at once if it has)."""
        self._scope = scope
        if self.gone:
            scope.cancel()

    def stop(self) -> None:
        self._task.cancel()

    async def _watch(self, receive: Receive, path: str) -> None:
        await until_disconnect(receive, path)
        self.gone = True
        if self._scope is not None:
            self._scope.cancel()


class RelayedStream(EventStreamResponse):
    """A replica's stream as the front end relays it, under the :class:`ClientWatch` of
    its forward (set before the response is sent)."""

    watch: ClientWatch
    one_producer = True  # the relay's one loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False
        try:
            with anyio.CancelScope() as cancelled_by:
                self.watch.cancels(cancelled_by)
                finished = await self.send_events(scope, send, cancelled_by)
        finally:
            self.watch.stop()
            self._on_close()
        await self.send_end(scope, send, finished=finished)


__all__ = ["ClientWatch", "RelayedStream"]
