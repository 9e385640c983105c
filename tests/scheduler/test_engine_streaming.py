"""The async engine: streaming, cancellation, abort, preemption and prefix hits end to end."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import anyio
import attrs
import pytest

from hybridkv.policies import FullAttention, SlidingWindow
from hybridkv.policies.base import IsCached
from hybridkv.scheduler import (
    Engine,
    EngineConfig,
    EngineStoppedError,
    FakeExecutor,
    FinishReason,
    PoolSpec,
    RequestOutput,
    SamplingParams,
    StepBatch,
    StepResult,
)
from hybridkv.scheduler.fake import reference_tokens

VOCAB = 1000


def make_config(**options: Any) -> EngineConfig:
    settings: dict[str, Any] = {
        "policies": [FullAttention(), SlidingWindow(window=16)],
        "num_blocks": 2049,
        "block_size": 16,
        "max_model_len": 512,
        "max_num_batched_tokens": 1024,
        "vocab_size": VOCAB,
    }
    settings.update(options)
    return EngineConfig(**settings)


class GatedExecutor:
    """The fake executor, but each step waits until the test opens the gate."""

    def __init__(self, config: EngineConfig) -> None:
        self.fake = FakeExecutor.for_config(config)
        self.started = threading.Event()
        self.gate = threading.Event()

    @property
    def pool(self) -> PoolSpec:
        return self.fake.pool

    def execute(self, batch: StepBatch) -> StepResult:
        self.started.set()
        assert self.gate.wait(timeout=20), "the test never opened the gate"
        return self.fake.execute(batch)

    async def wait_started(self) -> None:
        await anyio.to_thread.run_sync(self.started.wait)


async def wait_pool_full(engine: Engine) -> None:
    """Wait (under the caller's deadline) until every page is free again."""
    await engine.wait_until(lambda s: s.num_free_blocks == engine.config.num_blocks - 1)
    engine.core.kv.check_integrity()


def prompt_for(i: int, length: int) -> list[int]:
    return [(i * 31 + j * 7) % VOCAB for j in range(length)]


@pytest.mark.asyncio
async def test_thousand_concurrent_requests_stream_in_order_and_complete() -> None:
    """1,000 concurrent requests each stream every token once, in order, then finish."""
    config = make_config(max_num_seqs=256)
    results: dict[int, list[RequestOutput]] = {}

    async def consume(engine: Engine, i: int) -> None:
        params = SamplingParams(max_tokens=1 + i % 16, ignore_eos=True)
        stream = engine.generate(prompt_for(i, 8 + i % 40), params, request_id=f"r{i}")
        results[i] = [out async for out in stream]

    with anyio.fail_after(60):
        async with Engine(config, FakeExecutor.for_config(config)) as engine:
            async with anyio.create_task_group() as tg:
                for i in range(1000):
                    tg.start_soon(consume, engine, i)
            await wait_pool_full(engine)
    for i, outs in results.items():
        n = 1 + i % 16
        assert [o.num_output_tokens for o in outs] == list(range(1, n + 1))
        assert [o.finish_reason for o in outs] == [None] * (n - 1) + [FinishReason.LENGTH]
        tokens = [t for o in outs for t in o.new_token_ids]
        assert (
            tokens
            == list(outs[-1].token_ids)
            == reference_tokens(prompt_for(i, 8 + i % 40), n, VOCAB)
        )
        assert all(o.request_id == f"r{i}" for o in outs)


@pytest.mark.asyncio
async def test_break_aborts_the_request_and_frees_its_pages() -> None:
    """Leaving ``async for`` early ends the request at once and its pages come back."""
    config = make_config()
    with anyio.fail_after(10):
        async with Engine(config, FakeExecutor.for_config(config)) as engine:
            async for out in engine.generate([1, 2, 3], SamplingParams(max_tokens=400)):
                if out.num_output_tokens == 3:
                    break
            assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0
            await wait_pool_full(engine)


@pytest.mark.asyncio
async def test_cancelled_consumer_aborts_its_request() -> None:
    """Cancelling the task that iterates aborts the request; the pool is full again after."""
    config = make_config()
    first = anyio.Event()
    with anyio.fail_after(10):
        async with Engine(config, FakeExecutor.for_config(config)) as engine:

            async def consume(scope: anyio.CancelScope) -> None:
                with scope:
                    async for _ in engine.generate([5] * 40, SamplingParams(max_tokens=400)):
                        first.set()

            scope = anyio.CancelScope()
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume, scope)
                await first.wait()
                scope.cancel()
            assert engine.stats().num_running == 0
            await wait_pool_full(engine)


@pytest.mark.asyncio
async def test_close_during_a_step_keeps_pages_until_the_step_returns() -> None:
    """A request closed while its step runs ends at once; its pages are freed after the step."""
    config = make_config()
    executor = GatedExecutor(config)
    with anyio.fail_after(10):
        async with Engine(config, executor) as engine:
            stream = engine.generate([9] * 33, SamplingParams(max_tokens=5))
            await executor.wait_started()
            await stream.aclose()
            stats = engine.stats()
            assert stats.num_running == 0 and sum(stats.blocks_used_per_group) == 6
            executor.gate.set()
            await wait_pool_full(engine)


@pytest.mark.asyncio
async def test_abort_from_elsewhere_ends_the_stream_with_abort() -> None:
    """``engine.abort`` ends the request's stream with finish reason ``abort``."""
    config = make_config()
    executor = GatedExecutor(config)
    with anyio.fail_after(10):
        async with Engine(config, executor) as engine:
            stream = engine.generate([4] * 10, SamplingParams(max_tokens=50), request_id="x")
            await executor.wait_started()
            assert engine.abort("x") and not engine.abort("x")
            outs = [out async for out in stream]
            assert [o.finish_reason for o in outs] == [FinishReason.ABORT]
            executor.gate.set()
            await wait_pool_full(engine)


async def run_all(config: EngineConfig, prompts: list[list[int]], max_tokens: int) -> Any:
    """Run every prompt concurrently; return their token lists and the final stats."""
    tokens: dict[int, list[int]] = {}

    async def consume(engine: Engine, i: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        tokens[i] = [
            t async for out in engine.generate(prompts[i], params) for t in out.new_token_ids
        ]

    async with Engine(config, FakeExecutor.for_config(config)) as engine:
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(consume, engine, i)
        await wait_pool_full(engine)
        return tokens, engine.stats()


@pytest.mark.asyncio
async def test_preemption_in_a_small_pool_gives_the_same_outputs() -> None:
    """Outputs under a pool small enough to force preemption equal those of a large pool."""
    prompts = [prompt_for(i, 20 + 9 * i) for i in range(24)]
    with anyio.fail_after(30):
        large, large_stats = await run_all(make_config(), prompts, 40)
        small, small_stats = await run_all(make_config(num_blocks=41), prompts, 40)
    assert large_stats.num_preemptions == 0 and small_stats.num_preemptions > 0
    assert small == large
    assert large == {i: reference_tokens(p, 40, VOCAB) for i, p in enumerate(prompts)}


@pytest.mark.asyncio
async def test_shared_system_prompt_is_served_from_the_prefix_cache() -> None:
    """Requests sharing a system prompt count its blocks as cached and still match the model."""
    config = make_config()
    system = prompt_for(99, 64)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with anyio.fail_after(10):
        async with Engine(config, FakeExecutor.for_config(config)) as engine:
            first = [out async for out in engine.generate([*system, 1, 2, 3], params)]
            assert first[-1].num_cached_tokens == 0
            outs: dict[int, list[RequestOutput]] = {}

            async def consume(i: int) -> None:
                outs[i] = [out async for out in engine.generate(system + [i] * 5, params)]

            async with anyio.create_task_group() as tg:
                for i in range(10):
                    tg.start_soon(consume, i)
            assert engine.stats().prefix_hit_rate > 0.5
    for i, stream in outs.items():
        assert stream[-1].num_cached_tokens == 64
        assert list(stream[-1].token_ids) == reference_tokens(system + [i] * 5, 4, VOCAB)


@pytest.mark.asyncio
async def test_cache_salt_separates_prefix_cache_entries() -> None:
    """The same prompt under another cache salt gets no prefix hit."""
    config = make_config()
    prompt = prompt_for(5, 48)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    with anyio.fail_after(10):
        async with Engine(config, FakeExecutor.for_config(config)) as engine:
            cached = {}
            for salt in ("tenant-a", "tenant-a", "tenant-b"):
                outs = [out async for out in engine.generate(prompt, params, cache_salt=salt)]
                cached.setdefault(salt, []).append(outs[-1].num_cached_tokens)
    assert cached == {"tenant-a": [0, 32], "tenant-b": [0]}


class SteppedExecutor:
    """The fake executor, running one step per permit the test hands out."""

    def __init__(self, config: EngineConfig) -> None:
        self.fake = FakeExecutor.for_config(config)
        self.permits = threading.Semaphore(0)
        self.num_entered = 0
        self.entered = threading.Condition()

    @property
    def pool(self) -> PoolSpec:
        return self.fake.pool

    def execute(self, batch: StepBatch) -> StepResult:
        with self.entered:
            self.num_entered += 1
            self.entered.notify_all()
        assert self.permits.acquire(timeout=20), "the test never released the step"
        return self.fake.execute(batch)

    def wait_entered(self, num_steps: int) -> None:
        """Return once ``num_steps`` steps have entered (from any thread)."""
        with self.entered:
            assert self.entered.wait_for(lambda: self.num_entered >= num_steps, timeout=20)


@pytest.mark.asyncio
async def test_outputs_stream_and_requests_arrive_while_a_step_runs() -> None:
    """While the executor is stuck in a step, the previous step's output streams and a new
    request is accepted."""
    config = make_config()
    executor = SteppedExecutor(config)
    with anyio.fail_after(10):
        async with Engine(config, executor) as engine:
            stream = engine.generate([3] * 5, SamplingParams(max_tokens=3, ignore_eos=True))
            executor.permits.release()  # step 1 (the prompt) may run; step 2 may not
            await anyio.to_thread.run_sync(executor.wait_entered, 2)
            first = await stream.__anext__()
            assert first.new_token_ids == tuple(reference_tokens([3] * 5, 1, VOCAB))
            late = engine.generate([4] * 5, SamplingParams(max_tokens=1))
            assert engine.stats().num_waiting == 1
            for _ in range(10):
                executor.permits.release()
            assert [o.num_output_tokens async for o in stream] == [2, 3]
            assert [o.num_output_tokens async for o in late] == [1]


_PLANNING_HOOKS: list[Callable[[], object]] = []


@attrs.frozen
class HookedFullAttention(FullAttention):
    """Full attention that runs the queued hooks when the planner looks up a prefix."""

    name: ClassVar[str] = "hooked_full"

    def longest_hit(self, max_blocks: int, block_size: int, is_cached: IsCached) -> int:
        while _PLANNING_HOOKS:
            _PLANNING_HOOKS.pop()()
        return super().longest_hit(max_blocks, block_size, is_cached)


@pytest.mark.asyncio
async def test_iterator_collected_while_the_engine_plans_leaves_other_requests_alone() -> None:
    """A dropped iterator finalized by the GC in the middle of planning loses no other request."""
    config = make_config(policies=[HookedFullAttention()], num_blocks=65, block_size=4)
    gc.disable()  # the cycle below is collected only by the hook, mid-plan
    try:
        with anyio.fail_after(10):
            async with Engine(config, FakeExecutor.for_config(config)) as engine:
                dropped = engine.generate([1] * 9, SamplingParams(max_tokens=3))
                cycle: list[object] = [dropped]
                cycle.append(cycle)
                del dropped, cycle
                _PLANNING_HOOKS.append(gc.collect)
                params = SamplingParams(max_tokens=3, ignore_eos=True)
                outs = [out async for out in engine.generate([2] * 9, params)]
                assert [o.num_output_tokens for o in outs] == [1, 2, 3]
                await wait_pool_full(engine)
    finally:
        _PLANNING_HOOKS.clear()
        gc.enable()


@pytest.mark.asyncio
async def test_wait_until_wakes_on_the_change_it_waits_for() -> None:
    """``wait_until`` returns the first stats that satisfy it: a request running while its
    step is held, then a free pool once it finished; no polling, no clock."""
    config = make_config()
    executor = GatedExecutor(config)
    with anyio.fail_after(20):
        async with Engine(config, executor) as engine:
            stream = engine.generate([3] * 5, SamplingParams(max_tokens=2, ignore_eos=True))
            running = await engine.wait_until(lambda s: s.num_running == 1)
            assert running.num_waiting == 0 and sum(running.blocks_used_per_group) > 0
            executor.gate.set()
            outputs = [out async for out in stream]
            assert outputs[-1].finish_reason is FinishReason.LENGTH
            free = await engine.wait_until(lambda s: s.num_free_blocks == config.num_blocks - 1)
            assert free.num_running == 0


@pytest.mark.asyncio
async def test_wait_until_raises_once_the_engine_has_stopped() -> None:
    """A state that can no longer come is an EngineStoppedError, not a hang."""
    config = make_config()
    async with Engine(config, FakeExecutor.for_config(config)) as engine:
        pass
    with anyio.fail_after(10), pytest.raises(EngineStoppedError, match="stopped"):
        await engine.wait_until(lambda s: s.num_finished > 0)
