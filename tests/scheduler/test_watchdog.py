"""The step watchdog: a step past the limit breaks the executor, plain or pipelined."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from hybridkv.policies import FullAttention
from hybridkv.scheduler import (
    EngineConfig,
    ExecutorBrokenError,
    FakeExecutor,
    PipelinedFakeExecutor,
    SamplingParams,
    StepBatch,
    StepRequest,
    StepResult,
)
from hybridkv.scheduler.watchdog import StepWatchdog

CONFIG = EngineConfig(policies=[FullAttention()], num_blocks=16, block_size=4, max_model_len=32)


def batch(prompt: list[int]) -> StepBatch:
    request = StepRequest(
        request_id="r",
        token_ids=prompt,
        start_position=0,
        block_tables=[[1, 2]],
        sample=True,
        params=SamplingParams(),
        output_index=0,
    )
    return StepBatch((request,))


class Stuck(FakeExecutor):
    """Steps whose first token is 9 wait until released."""

    def __init__(self) -> None:
        super().__init__(CONFIG.pool, vocab_size=64)
        self.release = threading.Event()

    def execute(self, step: StepBatch) -> StepResult:
        if step.requests[0].token_ids[0] == 9:
            self.release.wait(30)
        return super().execute(step)


@pytest.fixture
def stuck() -> Iterator[Stuck]:
    executor = Stuck()
    yield executor
    executor.release.set()


def test_fast_steps_pass_through(stuck: Stuck) -> None:
    """A step under the limit returns the executor's result."""
    watched = StepWatchdog(stuck, 5.0)
    assert watched.execute(batch([2, 3])) == stuck.execute(batch([2, 3]))


def test_slow_step_breaks_the_executor(stuck: Stuck) -> None:
    """Past the limit the step raises ExecutorBrokenError, and every later step too."""
    watched = StepWatchdog(stuck, 0.2)
    with pytest.raises(ExecutorBrokenError, match=r"longer than 0\.2 s"):
        watched.execute(batch([9, 3]))
    with pytest.raises(ExecutorBrokenError):
        watched.execute(batch([2, 3]))


def test_step_errors_pass_through(stuck: Stuck) -> None:
    """An executor's own error is raised as is, and the executor is not marked broken."""
    watched = StepWatchdog(stuck, 5.0)
    with pytest.raises(IndexError):
        watched.execute(batch([2, 3] * 8))  # more tokens than its two pages hold
    assert watched.error is None


def test_pipelined_futures_expire(stuck: Stuck) -> None:
    """A pipelined executor's step future fails past the limit; quick ones succeed."""
    with PipelinedFakeExecutor(stuck, num_stages=2) as pipelined:
        watched = StepWatchdog(pipelined, 0.2)
        assert watched.max_steps_in_flight == 2
        assert watched.submit(batch([2, 3])).result(timeout=10).token_ids
        with pytest.raises(ExecutorBrokenError):
            watched.submit(batch([9, 3])).result(timeout=10)
        stuck.release.set()


def test_other_attributes_come_from_the_executor(stuck: Stuck) -> None:
    """vocab_size, pool and the like are the watched executor's."""
    watched = StepWatchdog(stuck, 1.0)
    assert (watched.pool, watched.vocab_size) == (stuck.pool, 64)
