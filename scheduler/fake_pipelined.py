"""The fake executor behind a chain of stage threads: several steps in flight, in order,
as with pipeline-parallel stages (``hybridkv.scheduler.fake`` has the fake itself)."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from types import TracebackType

from hybridkv.memory.layout import PoolSpec
from hybridkv.scheduler.batch import StepBatch, StepResult
from hybridkv.scheduler.fake import FakeExecutor


class PipelinedFakeExecutor:
    """The fake behind ``num_stages`` stage threads: several steps in flight, in order.

    Each stage takes steps from its queue in submission order, sleeps ``stage_delay_s``
    (its share of the model) and hands the step on; the last stage runs the fake. Steps
    therefore reach the blocks in the order they were submitted, as with real pipeline
    stages, and up to ``num_stages`` steps overlap. Close it (or use ``with``) to end the
    threads.
    """

    def __init__(
        self, fake: FakeExecutor, *, num_stages: int = 2, stage_delay_s: float = 0.0
    ) -> None:
        self.fake = fake
        self.max_steps_in_flight = num_stages
        self.stage_delay_s = stage_delay_s
        self.peak_steps_in_flight = 0  # most steps submitted and unfinished at once
        self._num_in_flight = 0
        self._lock = threading.Lock()
        self._queues: list[queue.SimpleQueue[tuple[StepBatch, Future[StepResult]] | None]] = [
            queue.SimpleQueue() for _ in range(num_stages)
        ]
        self._threads = [
            threading.Thread(target=self._stage, args=(i,), name=f"fake-stage-{i}", daemon=True)
            for i in range(num_stages)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def pool(self) -> PoolSpec:
        """The fake's pool."""
        return self.fake.pool

    @property
    def verifies_proposals(self) -> bool:
        """Whether the fake behind the stages verifies proposed tokens."""
        return self.fake.verifies_proposals

    def submit(self, batch: StepBatch) -> Future[StepResult]:
        """Queue the step at the first stage; its future completes after the last."""
        future: Future[StepResult] = Future()
        with self._lock:
            self._num_in_flight += 1
            self.peak_steps_in_flight = max(self.peak_steps_in_flight, self._num_in_flight)
        self._queues[0].put((batch, future))
        return future

    def execute(self, batch: StepBatch) -> StepResult:
        """Run one step through every stage and wait for it."""
        return self.submit(batch).result()

    def close(self) -> None:
        """End the stage threads once the steps already submitted are done."""
        self._queues[0].put(None)
        for thread in self._threads:
            thread.join()

    def __enter__(self) -> PipelinedFakeExecutor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _stage(self, index: int) -> None:
        is_last = index == len(self._queues) - 1
        while (item := self._queues[index].get()) is not None:
            if self.stage_delay_s:
                time.sleep(self.stage_delay_s)
            if not is_last:
                self._queues[index + 1].put(item)
                continue
            batch, future = item
            try:
                result = self.fake.execute(batch)
            except BaseException as exc:  # handed to the engine, which fails the step
                self._done()
                future.set_exception(exc)
            else:
                self._done()
                future.set_result(result)
        if not is_last:
            self._queues[index + 1].put(None)

    def _done(self) -> None:
        with self._lock:
            self._num_in_flight -= 1


__all__ = ["PipelinedFakeExecutor"]
