"""The async engine under stress: backpressure, bad requests, failing executors, shutdown."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from hybridkv.policies import FullAttention
from hybridkv.scheduler import (
    Engine,
    EngineConfig,
    EngineOverloadedError,
    EngineStoppedError,
    ExecutorBrokenError,
    FakeExecutor,
    FinishReason,
    PoolSpec,
    PromptTooLongError,
    RequestFailedError,
    RequestOutput,
    SamplingParams,
    StepBatch,
    StepResult,
)
from hybridkv.scheduler.fake import reference_tokens

VOCAB = 1000
POISON = 999


def make_config(**options: Any) -> EngineConfig:
    settings: dict[str, Any] = {
        "policies": [FullAttention()],
        "num_blocks": 257,
        "block_size": 16,
        "max_model_len": 1024,
        "vocab_size": VOCAB,
    }
    settings.update(options)
    return EngineConfig(**settings)


class ScriptedExecutor:
    """The fake executor, plus a gate, a poison token and a way to break for good."""

    def __init__(self, config: EngineConfig, *, breaks: bool = False) -> None:
        self.fake = FakeExecutor.for_config(config)
        self.breaks = breaks
        self.started = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    @property
    def pool(self) -> PoolSpec:
        return self.fake.pool

    def execute(self, batch: StepBatch) -> StepResult:
        self.started.set()
        assert self.gate.wait(timeout=20), "the test never opened the gate"
        if self.breaks:
            raise ExecutorBrokenError("device lost")
        if any(POISON in r.token_ids for r in batch.requests):
            raise RuntimeError("poisoned step")
        return self.fake.execute(batch)


async def collect(engine: Engine, prompt: list[int], max_tokens: int = 4) -> list[RequestOutput]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [out async for out in engine.generate(prompt, params)]


async def wait_pool_full(engine: Engine) -> None:
    await engine.wait_until(lambda s: s.num_free_blocks == engine.config.num_blocks - 1)


@pytest.mark.asyncio
async def test_backpressure_refuses_requests_past_max_waiting() -> None:
    """With ``max_waiting`` requests queued, ``generate`` raises at once; the rest are served."""
    config = make_config(max_num_seqs=1, max_waiting=2)
    executor = ScriptedExecutor(config)
    executor.gate.clear()
    with anyio.fail_after(10):
        async with Engine(config, executor) as engine:
            streams = [engine.generate([1, 2], SamplingParams(max_tokens=2))]
            await anyio.to_thread.run_sync(executor.started.wait)  # the first one runs
            streams += [engine.generate([3, 4], SamplingParams(max_tokens=2)) for _ in range(2)]
            with pytest.raises(EngineOverloadedError, match="max_waiting=2"):
                engine.generate([5, 6], SamplingParams(max_tokens=2))
            executor.gate.set()
            for stream in streams:
                outs = [out async for out in stream]
                assert outs[-1].finish_reason is FinishReason.LENGTH
            await wait_pool_full(engine)


@pytest.mark.asyncio
async def test_request_that_can_never_fit_fails_at_once_and_others_go_on() -> None:
    """Too long for the model or the pool: ``generate`` raises; other requests are unaffected."""
    config = make_config(num_blocks=9, max_model_len=1024)
    with anyio.fail_after(10):
        async with Engine(config, FakeExecutor.for_config(config)) as engine:
            with pytest.raises(PromptTooLongError, match="max_model_len=1024"):
                engine.generate([1] * 1024)
            with pytest.raises(PromptTooLongError, match="more than the pool's 8"):
                engine.generate([1] * 200, SamplingParams(max_tokens=1))
            outs = await collect(engine, [1, 2, 3])
            assert list(outs[-1].token_ids) == reference_tokens([1, 2, 3], 4, VOCAB)


@pytest.mark.asyncio
async def test_executor_error_fails_only_that_steps_requests() -> None:
    """A step that raises fails its request with the cause; other steps' requests finish."""
    config = make_config(max_num_seqs=1)
    with anyio.fail_after(10):
        async with Engine(config, ScriptedExecutor(config)) as engine:
            results: dict[int, Any] = {}

            async def consume(i: int, prompt: list[int]) -> None:
                try:
                    results[i] = await collect(engine, prompt)
                except RequestFailedError as exc:
                    results[i] = exc

            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(consume, i, [i + 1, POISON if i == 2 else i + 2])
            error = results.pop(2)
            assert isinstance(error, RequestFailedError)
            assert isinstance(error.__cause__, RuntimeError)
            for i, outs in results.items():
                assert list(outs[-1].token_ids) == reference_tokens([i + 1, i + 2], 4, VOCAB)
            await wait_pool_full(engine)
            assert engine.is_running
            await collect(engine, [7, 7])


@pytest.mark.asyncio
async def test_broken_executor_stops_the_engine_and_tells_every_waiter() -> None:
    """ExecutorBrokenError stops the loop; every pending request raises EngineStoppedError."""
    config = make_config(max_num_seqs=2)
    errors: list[BaseException] = []
    with anyio.fail_after(10), capture_logs() as logs:
        async with Engine(config, ScriptedExecutor(config, breaks=True)) as engine:

            async def consume(i: int) -> None:
                try:
                    await collect(engine, [i + 1] * 3)
                except EngineStoppedError as exc:
                    errors.append(exc)

            async with anyio.create_task_group() as tg:
                for i in range(5):
                    tg.start_soon(consume, i)
            assert not engine.is_running
            assert isinstance(engine.error, ExecutorBrokenError)
            with pytest.raises(EngineStoppedError):
                engine.generate([1])
    assert len(errors) == 5
    assert all(isinstance(e.__cause__, ExecutorBrokenError) for e in errors)
    assert engine.core.kv.num_free_blocks == config.num_blocks - 1
    assert any(e["event"] == "engine_broken" for e in logs)


@pytest.mark.asyncio
async def test_shutdown_with_requests_in_flight_ends_them_with_shutdown() -> None:
    """Leaving ``async with`` while requests run ends each with finish reason ``shutdown``."""
    config = make_config(max_num_seqs=2)
    last: dict[int, RequestOutput] = {}
    started = anyio.Event()
    executor = FakeExecutor.for_config(config, step_delay_s=0.002)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg, Engine(config, executor) as engine:

            async def consume(i: int) -> None:
                params = SamplingParams(max_tokens=900, ignore_eos=True)
                async for out in engine.generate([i + 1] * 20, params):
                    last[i] = out
                    started.set()

            for i in range(4):
                tg.start_soon(consume, i)
            await started.wait()
    assert [last[i].finish_reason for i in range(4)] == [FinishReason.SHUTDOWN] * 4
    assert engine.core.kv.num_free_blocks == config.num_blocks - 1
    with pytest.raises(EngineStoppedError):
        engine.generate([1])


@pytest.mark.asyncio
async def test_lifecycle_events_are_logged() -> None:
    """Admission, preemption and finish are structlog events with counts and durations."""
    config = make_config(num_blocks=5, block_size=4, max_model_len=16)
    with anyio.fail_after(10), capture_logs() as logs:
        async with Engine(config, FakeExecutor.for_config(config)) as engine:
            params = SamplingParams(max_tokens=8, ignore_eos=True)
            streams = [engine.generate([i + 1] * 6, params) for i in range(2)]
            for stream in streams:
                assert [out async for out in stream][-1].num_output_tokens == 8
    events = [e["event"] for e in logs]
    assert events.count("request_admitted") >= 2
    assert "request_preempted" in events
    finished = [e for e in logs if e["event"] == "request_finished"]
    assert len(finished) == 2
    assert all(e["num_output_tokens"] == 8 and e["duration_s"] >= 0 for e in finished)


@pytest.mark.asyncio
async def test_engine_serves_once_and_refuses_requests_outside_its_lifetime() -> None:
    """``generate`` before start or after stop raises; a stopped engine cannot restart."""
    config = make_config()
    engine = Engine(config, FakeExecutor.for_config(config))
    with pytest.raises(EngineStoppedError, match="not running"):
        engine.generate([1])
    with anyio.fail_after(10):
        async with engine:
            assert engine.is_running
        with pytest.raises(EngineStoppedError, match="serves once"):
            async with engine:
                pass
