"""One thread that runs all of an executor's torch work: loading, cache allocation, steps.

Why. torch's CPU ops run on OpenMP, whose thread team belongs to the thread that starts a
parallel region. The engine calls the executor from worker threads, while weights are
loaded on the caller's thread; each of those threads then owns a team, and once libgomp
manages more threads than there are CPUs it stops spinning between parallel regions, so
every mid-sized op pays a thread wake-up (``python -m benchmarks.decode.bandwidth``
measured every decode step 1.6x slower with a second team; docs/benchmarks.md, "Decode on
the CPU"). Running everything on one long-lived thread keeps one team busy and the
others never made.

Close the thread (``close``) before running torch work elsewhere in the same process, so
that its idle team does not slow the other thread down in turn.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


class TorchThread:
    """A single worker thread; ``run`` calls a function on it and waits for the result."""

    def __init__(self, num_threads: int | None = None) -> None:
        """Args:
        num_threads: torch intra-op threads, set on the worker (None: torch's choice).
        """
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="hybridkv-torch"
        )
        if num_threads is not None:
            self.run(torch.set_num_threads, num_threads)

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the worker thread; its exception is raised here.

        After ``close``, or once the interpreter exits, runs ``fn`` on the calling thread.
        """
        return self.submit(fn, *args).result()

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Queue ``fn(*args)`` on the worker thread without waiting; calls run in
        submission order, one at a time.

        After ``close``, or once the interpreter exits (``atexit`` handlers run after
        ``concurrent.futures`` has finished the queue and ended the worker), runs ``fn``
        now on the calling thread: the worker runs nothing any more.
        """
        if self._pool is not None:
            try:
                return self._pool.submit(fn, *args)
            except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
                pass
        future: Future[T] = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to the caller through the future
            future.set_exception(exc)
        return future

    def close(self) -> None:
        """End the worker thread (and its OpenMP team); later calls run inline."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
