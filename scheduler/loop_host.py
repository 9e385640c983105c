"""Where the engine's loop runs on asyncio: a host task of its own.

anyio requires a task group (a cancel scope) to be exited by the task that entered it.
pytest-asyncio sets an async fixture up in one task and tears it down in another, and an
application may start an engine in one request handler and stop it in another; so on
asyncio :class:`~hybridkv.scheduler.engine.Engine` starts an :class:`AsyncioHost`, a task
that owns the loop's task group from start to stop, and the entering and exiting tasks
only signal it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio


def on_asyncio() -> bool:
    """Whether the running event loop is asyncio's (not trio)."""
    try:
        return asyncio.current_task() is not None
    except RuntimeError:
        return False


class AsyncioHost:
    """An asyncio task that owns the loop's task group: started and stopped from any
    task, while every cancel scope stays inside the host (anyio's rule)."""

    def __init__(self, serve: Callable[..., Any]) -> None:
        self._serve = serve
        self._task: asyncio.Task[None] | None = None
        self._started = asyncio.Event()
        self._stop = asyncio.Event()

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="hybridkv-engine")
        waiter = asyncio.ensure_future(self._started.wait())
        try:
            await asyncio.wait({self._task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if self._task.done():
            self._task.result()  # the loop failed to start: raise its error here

    async def stop(self) -> None:
        assert self._task is not None
        self._stop.set()
        await asyncio.wait({self._task})  # not cancelled if the stopping task is
        self._task.result()

    async def _run(self) -> None:
        async with anyio.create_task_group() as task_group:
            await task_group.start(self._serve)
            self._started.set()
            await self._stop.wait()
            task_group.cancel_scope.cancel()  # stops the loop once the step in flight returns
