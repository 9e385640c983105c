"""A step watchdog: an executor whose step runs past a time limit is declared broken.

A hung step (a deadlocked collective, a stuck device) used to be invisible: ``/health``
stayed 200 and every request waited forever. Wrapped in :class:`StepWatchdog`, a step
that has not returned after ``timeout_s`` raises
:class:`~hybridkv.scheduler.batch.ExecutorBrokenError`; the engine then stops and ends
every pending request with a clear error, ``/health`` answers 503, and each later step
fails at once::

    engine worker thread --execute--> watchdog --queue--> step thread --> executor
                         <--result or ExecutorBrokenError after timeout_s--

The step runs on the watchdog's own daemon thread, so the engine's thread is never the
one stuck in it (a thread cannot be interrupted, and a daemon one does not hold up the
process's exit). With a pipelined executor, each submitted step's future gets the same
deadline.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError

from hybridkv.errors.events import get_logger
from hybridkv.memory.layout import PoolSpec
from hybridkv.scheduler.batch import Executor, ExecutorBrokenError, StepBatch, StepResult

log = get_logger(__name__)


class StepWatchdog:
    """An executor that fails a step running longer than ``timeout_s``, and all after it.

    Args:
        executor: The executor to watch (pipelined or not).
        timeout_s: Longest a step may run.
    """

    def __init__(self, executor: Executor, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.executor = executor
        self.timeout_s = timeout_s
        self.error: ExecutorBrokenError | None = None
        self._lock = threading.Lock()
        self._steps: queue.SimpleQueue[tuple[StepBatch, Future[StepResult]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @property
    def pool(self) -> PoolSpec:
        """The watched executor's pool."""
        return self.executor.pool

    @property
    def max_steps_in_flight(self) -> int:
        """As the watched executor (1 unless it is pipelined)."""
        return int(getattr(self.executor, "max_steps_in_flight", 1))

    def __getattr__(self, name: str) -> object:
        # vocab_size, tokenizer, sampler, close(): whatever else the executor offers.
        if name == "executor":
            raise AttributeError(name)
        return getattr(self.executor, name)

    def execute(self, batch: StepBatch) -> StepResult:
        """Run the step on the step thread; raise ExecutorBrokenError past the limit."""
        self._check()
        future: Future[StepResult] = Future()
        self._start_thread()
        self._steps.put((batch, future))
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeoutError:
            raise self._break(batch) from None

    def submit(self, batch: StepBatch) -> Future[StepResult]:
        """A pipelined executor's submit, whose future fails past the limit."""
        self._check()
        inner: Future[StepResult] = self.executor.submit(batch)  # type: ignore[attr-defined]
        outer: Future[StepResult] = Future()
        timer = threading.Timer(self.timeout_s, self._expire, args=(outer, batch))
        timer.daemon = True
        inner.add_done_callback(lambda done: self._settle(outer, done, timer.cancel))
        timer.start()
        return outer

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def _break(self, batch: StepBatch) -> ExecutorBrokenError:
        with self._lock:
            if self.error is None:
                self.error = ExecutorBrokenError(
                    f"a step of {len(batch.requests)} requests ran longer than "
                    f"{self.timeout_s:g} s (the step timeout): the executor is considered hung"
                )
                log.error(
                    "step_timeout", timeout_s=self.timeout_s, num_requests=len(batch.requests)
                )
            return self.error

    def _expire(self, outer: Future[StepResult], batch: StepBatch) -> None:
        error = self._break(batch)
        with self._lock:
            if not outer.done():
                outer.set_exception(error)

    def _settle(
        self, outer: Future[StepResult], inner: Future[StepResult], cancel: Callable[[], None]
    ) -> None:
        cancel()
        with self._lock:
            if outer.done():
                return
            error = inner.exception()
            if error is None:
                outer.set_result(inner.result())
            else:
                outer.set_exception(error)

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="step-watchdog", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            batch, future = self._steps.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = self.executor.execute(batch)
            except BaseException as exc:  # handed to the engine, which fails the step
                future.set_exception(exc)
            else:
                future.set_result(result)
