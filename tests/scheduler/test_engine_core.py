"""The engine core without a loop: validation, stopping, aborts, failures, shutdown."""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.policies import FullAttention, SlidingWindow
from hybridkv.scheduler import (
    EngineConfig,
    EngineOverloadedError,
    FinishReason,
    InvalidRequestError,
    PromptTooLongError,
    RequestFailedError,
    RequestOutput,
    SamplingParams,
)
from hybridkv.scheduler.core import EngineCore
from hybridkv.scheduler.fake import CollectingSink, FakeExecutor, reference_tokens


def make_core(**options: Any) -> EngineCore:
    settings: dict[str, Any] = {
        "policies": [FullAttention(), SlidingWindow(window=8)],
        "num_blocks": 65,
        "block_size": 4,
        "max_model_len": 64,
        "vocab_size": 50,
    }
    settings.update(options)
    return EngineCore(EngineConfig(**settings))


def run_to_end(core: EngineCore, fake: FakeExecutor, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not core.has_work:
            return
        plan = core.plan()
        core.apply(plan, fake.execute(plan.batch))
        core.flush()
    raise AssertionError("requests did not finish")


def generated(sink: CollectingSink) -> list[int]:
    return [t for out in sink.items for t in out.new_token_ids]


def assert_pool_empty(core: EngineCore) -> None:
    core.kv.check_integrity()
    assert core.kv.num_free_blocks == core.kv.num_usable_blocks


@pytest.mark.parametrize(
    ("prompt", "error"),
    [
        ([], InvalidRequestError),
        ([1, -2], InvalidRequestError),
        ([1, 50], InvalidRequestError),
        ([1.5], InvalidRequestError),
        (list(range(40)) + list(range(24)), PromptTooLongError),
    ],
)
def test_malformed_prompts_are_refused_at_once(prompt: list[Any], error: type[Exception]) -> None:
    """Empty prompts, ids outside the vocabulary, and over-long prompts raise before queueing."""
    core = make_core()
    with pytest.raises(error):
        core.add_request(prompt, SamplingParams(), CollectingSink(), request_id="x")
    assert not core.has_work


def test_token_ids_too_large_to_hash_are_refused_without_a_vocabulary() -> None:
    """With no vocab_size, an id past 32 bits raises at once instead of breaking the planner."""
    core = make_core(vocab_size=None)
    with pytest.raises(InvalidRequestError, match="token ids"):
        core.add_request([2**32, 1, 1, 1, 1], SamplingParams(), CollectingSink(), request_id="x")
    assert not core.has_work


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "5"),
        ("max_tokens", 2.5),
        ("max_tokens", True),
        ("min_tokens", None),
        ("temperature", "hot"),
        ("top_p", None),
        ("top_k", 1.5),
        ("seed", "x"),
        ("stop_token_ids", 5),
        ("stop_token_ids", ["a"]),
        ("stop_token_ids", [1.5]),
    ],
)
def test_sampling_params_of_the_wrong_type_are_refused(field: str, value: object) -> None:
    """A parameter of the wrong type raises InvalidRequestError naming it, not a TypeError."""
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})


def test_request_larger_than_the_pool_is_refused() -> None:
    """A request whose prompt and output need more pages than the pool has fails at once."""
    core = make_core(num_blocks=9, max_model_len=1000)
    with pytest.raises(PromptTooLongError, match="more than the pool's 8"):
        core.add_request([1] * 40, SamplingParams(max_tokens=10), CollectingSink(), request_id="x")


def test_duplicate_request_ids_are_refused() -> None:
    """A live request id cannot be reused."""
    core = make_core()
    core.add_request([1], SamplingParams(), CollectingSink(), request_id="x")
    with pytest.raises(InvalidRequestError, match="'x'"):
        core.add_request([1], SamplingParams(), CollectingSink(), request_id="x")


def test_waiting_queue_is_bounded() -> None:
    """Past ``max_waiting`` waiting requests, adding one raises EngineOverloadedError."""
    core = make_core(max_waiting=2)
    for rid in "ab":
        core.add_request([1], SamplingParams(), CollectingSink(), request_id=rid)
    with pytest.raises(EngineOverloadedError, match="max_waiting=2"):
        core.add_request([1], SamplingParams(), CollectingSink(), request_id="c")


def test_outputs_stream_one_token_per_step_and_match_the_reference() -> None:
    """Each step streams one new token; the final output carries the finish reason."""
    core = make_core()
    fake = FakeExecutor.for_config(core.config)
    sink = CollectingSink()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    core.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True), sink, request_id="a")
    run_to_end(core, fake)
    outs: list[RequestOutput] = sink.items
    assert [len(o.new_token_ids) for o in outs] == [1] * 6
    assert [o.finish_reason for o in outs] == [None] * 5 + [FinishReason.LENGTH]
    assert list(outs[-1].token_ids) == generated(sink) == reference_tokens(prompt, 6, 50)
    assert sink.is_closed
    assert_pool_empty(core)


def test_eos_stops_unless_ignored_and_not_before_min_tokens() -> None:
    """An EOS token ends a request with STOP, except under ignore_eos or before min_tokens."""
    prompt = [7, 7, 7]
    ref = reference_tokens(prompt, 10, 50)
    eos = ref[2]
    first_eos = ref.index(eos) + 1
    cases = {
        "plain": (SamplingParams(max_tokens=10), first_eos, FinishReason.STOP),
        "ignored": (SamplingParams(max_tokens=10, ignore_eos=True), 10, FinishReason.LENGTH),
        "min": (SamplingParams(max_tokens=10, min_tokens=first_eos + 1), None, None),
    }
    core = make_core(eos_token_ids=[eos])
    fake = FakeExecutor.for_config(core.config)
    sinks = {rid: CollectingSink() for rid in cases}
    for rid, (params, _, _) in cases.items():
        core.add_request(prompt, params, sinks[rid], request_id=rid)
    run_to_end(core, fake)
    for rid, (_, length, reason) in cases.items():
        out = sinks[rid].items[-1]
        if length is not None:
            assert (out.num_output_tokens, out.finish_reason) == (length, reason), rid
        else:  # min_tokens skips the first EOS; it stops at a later one or at max_tokens
            assert out.num_output_tokens > first_eos


def test_stop_token_ids_end_the_request() -> None:
    """A token in ``stop_token_ids`` ends the request with STOP; it is part of the output."""
    prompt = [2, 4, 6]
    ref = reference_tokens(prompt, 8, 50)
    core = make_core()
    fake = FakeExecutor.for_config(core.config)
    sink = CollectingSink()
    params = SamplingParams(max_tokens=8, stop_token_ids=(ref[3],))
    core.add_request(prompt, params, sink, request_id="a")
    run_to_end(core, fake)
    assert generated(sink) == ref[: ref.index(ref[3]) + 1]
    assert sink.items[-1].finish_reason is FinishReason.STOP


def test_max_model_len_ends_the_request() -> None:
    """A sequence reaching ``max_model_len`` tokens ends with LENGTH."""
    core = make_core(max_model_len=12)
    fake = FakeExecutor.for_config(core.config)
    sink = CollectingSink()
    core.add_request([1] * 10, SamplingParams(max_tokens=50, ignore_eos=True), sink, request_id="a")
    run_to_end(core, fake)
    assert (sink.items[-1].num_output_tokens, sink.items[-1].finish_reason) == (
        2,
        FinishReason.LENGTH,
    )


def test_abort_during_a_step_frees_pages_after_it() -> None:
    """An abort while the step runs ends the stream at once but frees pages after the step."""
    core = make_core()
    fake = FakeExecutor.for_config(core.config)
    sink = CollectingSink()
    core.add_request([1] * 9, SamplingParams(max_tokens=8), sink, request_id="a")
    plan = core.plan()
    assert core.abort("a")
    assert sink.is_closed and sink.items[-1].finish_reason is FinishReason.ABORT
    assert core.kv.num_free_blocks < core.kv.num_usable_blocks  # the step still uses them
    core.apply(plan, fake.execute(plan.batch))
    assert_pool_empty(core)
    assert not core.has_work


def test_abort_of_a_waiting_request_removes_it() -> None:
    """Aborting a queued request drops it from the queue; a second abort returns False."""
    core = make_core()
    core.add_request([1], SamplingParams(), CollectingSink(), request_id="a")
    assert core.abort("a") and not core.abort("a")
    assert len(core.waiting) == 0 and not core.has_work
    assert core.plan().scheduled == []


def test_failed_step_fails_its_requests_and_frees_their_pages() -> None:
    """When the executor raises, the step's requests fail with that cause; later ones run."""
    core = make_core(max_num_seqs=1)
    fake = FakeExecutor.for_config(core.config)
    first, second = CollectingSink(), CollectingSink()
    core.add_request([1, 2, 3], SamplingParams(max_tokens=3), first, request_id="a")
    core.add_request([4, 5, 6], SamplingParams(max_tokens=3), second, request_id="b")
    plan = core.plan()
    boom = RuntimeError("device fell over")
    core.fail(plan, boom)
    core.flush()
    (error,) = first.items
    assert isinstance(error, RequestFailedError) and error.__cause__ is boom
    run_to_end(core, fake)
    assert generated(second) == reference_tokens([4, 5, 6], 3, 50)
    assert_pool_empty(core)


def test_shutdown_ends_every_request_and_frees_the_pool() -> None:
    """Shutdown ends waiting, running and in-step requests with SHUTDOWN and frees all pages."""
    core = make_core(max_num_seqs=2)
    fake = FakeExecutor.for_config(core.config)
    sinks = [CollectingSink() for _ in range(3)]
    for i, sink in enumerate(sinks):
        core.add_request([i + 1] * 5, SamplingParams(max_tokens=9), sink, request_id=str(i))
    plan = core.plan()
    core.apply(plan, fake.execute(plan.batch))
    core.plan()  # a step in flight whose result never comes
    core.shutdown()
    assert [s.items[-1].finish_reason for s in sinks] == [FinishReason.SHUTDOWN] * 3
    assert all(s.is_closed for s in sinks)
    assert_pool_empty(core)


def test_stats_count_queues_and_pages() -> None:
    """``stats`` reports waiting and running requests and the pages held per group."""
    core = make_core(max_num_seqs=1)
    core.add_request([1] * 8, SamplingParams(), CollectingSink(), request_id="a")
    core.add_request([2] * 8, SamplingParams(), CollectingSink(), request_id="b")
    core.plan()
    stats = core.stats()
    assert (stats.num_waiting, stats.num_running, stats.num_preempted) == (1, 1, 0)
    assert stats.blocks_used_per_group == (2, 2)  # 8 tokens, 4 per page


def test_stats_report_recent_throughput() -> None:
    """Tokens per second come from the steps of the last seconds, by the core's clock."""
    now = [0.0]
    core = EngineCore(
        EngineConfig(policies=[FullAttention()], num_blocks=65, block_size=4, max_model_len=64),
        clock=lambda: now[0],
    )
    fake = FakeExecutor.for_config(core.config)
    core.add_request(
        [1] * 10, SamplingParams(max_tokens=5, ignore_eos=True), CollectingSink(), request_id="a"
    )
    for _ in range(5):  # one prefill step of 10 tokens, then 4 decodes, 0.5 s apart
        plan = core.plan()
        core.apply(plan, fake.execute(plan.batch))
        now[0] += 0.5
    stats = core.stats()  # steps ended at 0, 0.5, ..., 2.0; the rate runs until now, 2.5
    assert stats.output_tokens_per_second == 4 / 2.5
    assert stats.tokens_per_second == 4 / 2.5
    now[0] += 60
    assert core.stats().tokens_per_second == 0.0


def test_prefix_hit_rate_ignores_the_recomputation_of_preempted_requests() -> None:
    """Prompts that share nothing give a hit rate of 0, even when preemption recomputes them."""
    core = make_core(policies=[FullAttention()], num_blocks=9, max_model_len=32)
    fake = FakeExecutor.for_config(core.config)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    for i in range(2):
        core.add_request([i + 1] * 10, params, CollectingSink(), request_id=str(i))
    run_to_end(core, fake)
    stats = core.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_hit_rate == 0.0
