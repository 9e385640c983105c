"""Several steps in flight: the core plans step k+1 before step k is applied."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from hybridkv.policies import FullAttention, SlidingWindow
from hybridkv.scheduler import (
    Engine,
    EngineConfig,
    EngineStoppedError,
    ExecutorBrokenError,
    FakeExecutor,
    PipelinedFakeExecutor,
    RequestFailedError,
    RequestOutput,
    SamplingParams,
    StepResult,
)
from hybridkv.scheduler.core import EngineCore
from hybridkv.scheduler.fake import CollectingSink, reference_tokens

VOCAB = 50


def make_config(**options: Any) -> EngineConfig:
    settings: dict[str, Any] = {
        "policies": [FullAttention(), SlidingWindow(window=8)],
        "num_blocks": 65,
        "block_size": 4,
        "max_model_len": 96,
        "vocab_size": VOCAB,
    }
    settings.update(options)
    return EngineConfig(**settings)


def test_a_request_is_in_at_most_one_step_in_flight() -> None:
    """A second plan made before the first is applied holds none of the first's requests."""
    config = make_config()
    core, fake = EngineCore(config), FakeExecutor.for_config(config)
    sinks = [CollectingSink() for _ in range(3)]
    for i, sink in enumerate(sinks[:2]):
        core.add_request([1 + i, 2, 3], SamplingParams(max_tokens=4), sink, request_id=f"a{i}")
    first = core.plan()
    core.add_request([9, 9, 9], SamplingParams(max_tokens=4), sinks[2], request_id="b")
    second = core.plan()
    assert [r.request_id for r in first.scheduled] == ["a0", "a1"]
    assert [r.request_id for r in second.scheduled] == ["b"]
    assert not core.plan().scheduled  # everyone is in a step in flight
    assert core.num_steps_in_flight == 2
    core.apply(first, fake.execute(first.batch))
    core.apply(second, fake.execute(second.batch))
    core.flush()
    assert core.num_steps_in_flight == 0
    assert [len(s.items) for s in sinks] == [1, 1, 1]


def test_results_must_be_applied_in_planning_order() -> None:
    """Applying a later step before an earlier one is a bug the core refuses."""
    config = make_config()
    core, fake = EngineCore(config), FakeExecutor.for_config(config)
    core.add_request([1, 2], SamplingParams(), CollectingSink(), request_id="a")
    first = core.plan()
    core.add_request([3, 4], SamplingParams(), CollectingSink(), request_id="b")
    second = core.plan()
    with pytest.raises(AssertionError, match="order"):
        core.apply(second, fake.execute(second.batch))
    del first


def test_an_aborted_request_keeps_its_blocks_until_its_step_returns() -> None:
    """Aborting a request of a step in flight frees its blocks only when that step is applied."""
    config = make_config()
    core, fake = EngineCore(config), FakeExecutor.for_config(config)
    sink = CollectingSink()
    core.add_request(list(range(1, 11)), SamplingParams(max_tokens=8), sink, request_id="a")
    plan = core.plan()
    held = config.num_blocks - 1 - core.kv.num_free_blocks
    assert core.abort("a")
    assert config.num_blocks - 1 - core.kv.num_free_blocks == held > 0
    core.plan()  # planning meanwhile takes nothing of it
    core.apply(plan, fake.execute(plan.batch))
    core.kv.check_integrity()
    assert core.kv.num_free_blocks == core.kv.num_usable_blocks


def test_a_failed_step_fails_later_requests_that_hit_its_blocks() -> None:
    """A later step in flight that resumed from blocks a failed step was filling fails too."""
    config = make_config()
    core, fake = EngineCore(config), FakeExecutor.for_config(config)
    prompt = list(range(1, 14))
    first_sink, second_sink, other_sink = CollectingSink(), CollectingSink(), CollectingSink()
    core.add_request(prompt, SamplingParams(max_tokens=2), first_sink, request_id="a")
    first = core.plan()
    core.add_request(prompt, SamplingParams(max_tokens=2), second_sink, request_id="b")
    core.add_request([7, 7, 7], SamplingParams(max_tokens=2), other_sink, request_id="c")
    second = core.plan()
    assert second.scheduled[0].num_computed_tokens == 12  # "b" hit "a"'s blocks
    core.fail(first, RuntimeError("device error"))
    core.apply(second, fake.execute(second.batch))
    core.flush()
    for sink in (first_sink, second_sink):
        assert isinstance(sink.items[-1], RequestFailedError)
    assert "earlier step" in str(second_sink.items[-1])
    assert isinstance(other_sink.items[0], RequestOutput)  # no hit: unaffected


def workload_prompt(i: int) -> list[int]:
    """Shared prefixes of 0, 8 or 16 tokens, then 9 tokens of the request's own."""
    return [5, 6, 7, 8, 9, 10, 11, 12] * (i % 3) + [(i * 7 + j) % VOCAB for j in range(9)]


async def run_workload(engine: Engine, num_requests: int) -> dict[int, list[RequestOutput]]:
    """Shared prefixes, lengths past the window, chunked prompts; outputs per request."""
    results: dict[int, list[RequestOutput]] = {}

    async def consume(i: int) -> None:
        params = SamplingParams(max_tokens=6 + i % 20, ignore_eos=True)
        stream = engine.generate(workload_prompt(i), params, request_id=str(i))
        results[i] = [out async for out in stream]

    async with anyio.create_task_group() as tg:
        for i in range(num_requests):
            tg.start_soon(consume, i)
    return results


@pytest.mark.asyncio
async def test_pipelined_engine_gives_the_outputs_of_one_step_at_a_time() -> None:
    """With two stages in flight, chunking, prefix hits and preemption give the same tokens."""
    # 30 usable blocks for 40 requests: preemption is certain; chunks of 8 tokens.
    config = make_config(num_blocks=31, max_num_batched_tokens=24, max_prefill_chunk=8)
    with anyio.fail_after(60):
        async with Engine(config, FakeExecutor.for_config(config)) as engine:
            expected = await run_workload(engine, 40)
            serial = engine.stats()
        with PipelinedFakeExecutor(
            FakeExecutor.for_config(config), num_stages=2, stage_delay_s=0.002
        ) as pipelined:
            async with Engine(config, pipelined) as engine:
                got = await run_workload(engine, 40)
                stats = engine.stats()
                engine.core.kv.check_integrity()
                assert stats.num_free_blocks == config.num_blocks - 1
    assert pipelined.peak_steps_in_flight == 2
    assert serial.num_preemptions > 0 and stats.num_preemptions > 0
    for i, outs in got.items():
        tokens = [t for out in outs for t in out.new_token_ids]
        assert tokens == [t for out in expected[i] for t in out.new_token_ids]
        assert tokens == reference_tokens(workload_prompt(i), 6 + i % 20, VOCAB)


@pytest.mark.asyncio
async def test_pipelined_engine_fails_a_broken_step_and_keeps_serving() -> None:
    """A step that raises in a stage fails its requests; later requests are served."""

    class Poisoned(FakeExecutor):
        def execute(self, batch: Any) -> StepResult:
            if any(0 in r.token_ids for r in batch.requests):
                raise RuntimeError("poisoned step")
            return super().execute(batch)

    config = make_config()
    with PipelinedFakeExecutor(Poisoned(config.pool, vocab_size=VOCAB), num_stages=3) as fake:
        async with Engine(config, fake) as engine:
            with anyio.fail_after(20):
                with pytest.raises(RequestFailedError, match="poisoned"):
                    async for _ in engine.generate([0, 1, 2], SamplingParams(max_tokens=3)):
                        pass
                outs = [o async for o in engine.generate([3, 4], SamplingParams(max_tokens=3))]
    assert [t for o in outs for t in o.new_token_ids] == reference_tokens([3, 4], 3, VOCAB)


@pytest.mark.asyncio
async def test_a_broken_pipelined_executor_stops_the_engine_cleanly() -> None:
    """ExecutorBrokenError from a stage ends every request with EngineStoppedError and frees
    every block once the other steps in flight have returned."""

    class Broken(FakeExecutor):
        def execute(self, batch: Any) -> StepResult:
            if self.num_steps >= 3:
                raise ExecutorBrokenError("stage 1 lost")
            return super().execute(batch)

    config = make_config()
    with PipelinedFakeExecutor(Broken(config.pool, vocab_size=VOCAB), num_stages=2) as fake:
        async with Engine(config, fake) as engine:
            with anyio.fail_after(20):
                with pytest.raises(EngineStoppedError, match="stage 1 lost"):
                    async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=50)):
                        pass
                with pytest.raises(EngineStoppedError):
                    await engine.wait_until(lambda s: False)  # returns when it stops
            assert isinstance(engine.error, ExecutorBrokenError)
            engine.core.kv.check_integrity()
            assert engine.core.kv.num_free_blocks == engine.core.kv.num_usable_blocks


def test_ready_requests_are_spread_over_the_free_steps() -> None:
    """With two steps in flight allowed, eight decoding requests split four and four."""
    config = make_config()
    core, fake = EngineCore(config, max_steps_in_flight=2), FakeExecutor.for_config(config)
    for i in range(8):
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        core.add_request([1 + i, 2, 3], params, CollectingSink(), request_id=str(i))
    first, second = core.plan(), core.plan()
    assert (len(first.scheduled), len(second.scheduled)) == (4, 4)
    core.apply(first, fake.execute(first.batch))
    third = core.plan()  # one step free again: every ready request joins it
    assert {r.request_id for r in third.scheduled} == {r.request_id for r in first.scheduled}
    core.apply(second, fake.execute(second.batch))
    core.apply(third, fake.execute(third.batch))


@pytest.mark.asyncio
async def test_pipelined_decodes_overlap_without_a_token_budget() -> None:
    """Decode steps fill both stages even when one step could take every request."""
    config = make_config(max_num_batched_tokens=4096)
    with PipelinedFakeExecutor(
        FakeExecutor.for_config(config), num_stages=2, stage_delay_s=0.002
    ) as pipelined:
        async with Engine(config, pipelined) as engine:
            with anyio.fail_after(30):
                outs = await run_workload(engine, 8)
    assert pipelined.peak_steps_in_flight == 2
    for i, got in outs.items():
        tokens = [t for out in got for t in out.new_token_ids]
        assert tokens == reference_tokens(workload_prompt(i), 6 + i % 20, VOCAB)
