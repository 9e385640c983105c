"""Step planning without the loop: budget, chunking, order, admission, preemption."""

from __future__ import annotations

import zlib
from typing import Any

from hybridkv.policies import FullAttention, SlidingWindow
from hybridkv.scheduler import EngineConfig, SamplingParams
from hybridkv.scheduler.core import EngineCore
from hybridkv.scheduler.fake import CollectingSink, FakeExecutor
from hybridkv.scheduler.request import Request, RequestStatus
from hybridkv.scheduler.step_planner import StepPlan


def make_core(**options: Any) -> EngineCore:
    settings: dict[str, Any] = {
        "policies": [FullAttention()],
        "num_blocks": 257,
        "block_size": 4,
        "max_model_len": 512,
        "max_num_batched_tokens": 64,
    }
    settings.update(options)
    return EngineCore(EngineConfig(**settings))


def add(
    core: EngineCore, rid: str, prompt_len: int, *, max_tokens: int = 8, priority: int = 0
) -> Request:
    # A stable hash: Python's str hash changes per process, and one run in a thousand
    # gave a prompt that started as another test prompt does (a prefix hit).
    prompt = [(zlib.crc32(rid.encode()) + i) % 1000 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens)
    return core.add_request(prompt, params, CollectingSink(), request_id=rid, priority=priority)


def step(core: EngineCore, executor: FakeExecutor) -> StepPlan:
    plan = core.plan()
    core.apply(plan, executor.execute(plan.batch))
    core.flush()
    return plan


def ids(plan: StepPlan) -> list[str]:
    return [r.request_id for r in plan.scheduled]


def test_running_requests_are_planned_before_admissions() -> None:
    """Requests already running come first in the batch, newcomers after them."""
    core = make_core()
    fake = FakeExecutor.for_config(core.config)
    add(core, "a", 8)
    step(core, fake)
    add(core, "b", 8)
    plan = step(core, fake)
    assert ids(plan) == ["a", "b"]
    assert [item.num_tokens for item in plan.batch.requests] == [1, 8]


def test_long_prompt_is_chunked_by_the_token_budget() -> None:
    """A prompt longer than the budget runs in budget-sized chunks and samples only at the end."""
    core = make_core(max_num_batched_tokens=32)
    fake = FakeExecutor.for_config(core.config)
    add(core, "a", 100)
    chunks = []
    for _ in range(4):
        (item,) = step(core, fake).batch.requests
        chunks.append((item.start_position, item.num_tokens, item.sample))
    assert chunks == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)]


def test_prefill_chunk_lets_prompts_share_a_step() -> None:
    """``max_prefill_chunk`` caps each request's share so several prompts progress at once."""
    core = make_core(max_prefill_chunk=8)
    add(core, "a", 20)
    add(core, "b", 20)
    plan = core.plan()
    assert [item.num_tokens for item in plan.batch.requests] == [8, 8]
    assert plan.num_tokens == 16


def test_step_never_exceeds_the_token_budget() -> None:
    """Admission stops when the budget is spent; the last admitted request gets the rest."""
    core = make_core(max_num_batched_tokens=20)
    for rid in "abc":
        add(core, rid, 12)
    plan = core.plan()
    assert [item.num_tokens for item in plan.batch.requests] == [12, 8]
    assert plan.num_tokens == 20


def test_admission_follows_priority_then_arrival() -> None:
    """Lower priority values are admitted first; equal priorities in arrival order."""
    core = make_core(max_num_seqs=3, scheduling_policy="priority")
    add(core, "late-low", 4, priority=1)
    add(core, "first", 4)
    add(core, "urgent", 4, priority=-1)
    add(core, "second", 4)
    assert ids(core.plan()) == ["urgent", "first", "second"]


def test_max_num_seqs_caps_running_requests() -> None:
    """No more than ``max_num_seqs`` requests run; the rest wait."""
    core = make_core(max_num_seqs=2)
    for rid in "abc":
        add(core, rid, 4)
    plan = core.plan()
    assert ids(plan) == ["a", "b"]
    assert len(core.waiting) == 1


def test_preemption_takes_the_least_urgent_and_blocks_admission() -> None:
    """A request that cannot grow preempts the latest, lowest-priority one; nobody is admitted."""
    # 8 usable pages of 4 tokens: a (priority 0) and b (priority 1) fill them exactly.
    core = make_core(num_blocks=9, max_num_batched_tokens=64, scheduling_policy="priority")
    fake = FakeExecutor.for_config(core.config)
    a = add(core, "a", 16, max_tokens=12)
    b = add(core, "b", 16, max_tokens=12, priority=1)
    step(core, fake)
    add(core, "c", 4, priority=-5)  # urgent, but admission waits for pages
    plan = core.plan()
    assert ids(plan) == ["a"]
    assert plan.preempted == [b] and not plan.admitted
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert a.num_preemptions == 0 and b.num_preemptions == 1


def test_preempted_request_resumes_before_later_arrivals() -> None:
    """A preempted request keeps its arrival rank, so it is readmitted before newcomers."""
    core = make_core(num_blocks=9, max_num_seqs=2)
    fake = FakeExecutor.for_config(core.config)
    add(core, "a", 16, max_tokens=12)
    add(core, "b", 16, max_tokens=12)
    step(core, fake)
    add(core, "c", 4)
    assert [r.request_id for r in step(core, fake).preempted] == ["b"]
    while core.running and core.running[0].request_id == "a":
        plan = step(core, fake)
        if plan.admitted:
            break
    assert [r.request_id for r in plan.admitted][:1] == ["b"]


def test_admission_does_not_let_small_requests_overtake() -> None:
    """When the head of the queue does not fit, later (smaller) requests wait too."""
    core = make_core(num_blocks=9)
    fake = FakeExecutor.for_config(core.config)
    add(core, "a", 20, max_tokens=4)
    step(core, fake)
    add(core, "big", 12, max_tokens=2)
    add(core, "small", 1, max_tokens=2)
    plan = core.plan()
    assert ids(plan) == ["a"]
    assert len(core.waiting) == 2


def test_prefix_hit_starts_admission_after_the_cached_blocks() -> None:
    """A request sharing a cached prefix starts computing after it and reports the hit."""
    core = make_core()
    fake = FakeExecutor.for_config(core.config)
    prompt = list(range(20))
    core.add_request(prompt, SamplingParams(max_tokens=2), CollectingSink(), request_id="a")
    step(core, fake)
    b = core.add_request(
        [*prompt, 7], SamplingParams(max_tokens=2), CollectingSink(), request_id="b"
    )
    plan = core.plan()
    item = plan.batch.requests[-1]
    assert item.request_id == "b" and item.start_position == 20
    assert b.num_cached_tokens == 20


def _chat_then_long_prompt(min_prefill_chunk: int) -> tuple[list[int], int]:
    """Run a chat turn, then a long unrelated prompt in a tight hybrid pool, then the chat's
    next turn; returns the long prompt's chunk sizes and the next turn's cached tokens."""
    core = make_core(
        policies=[FullAttention(), SlidingWindow(window=8)],
        num_blocks=25,
        min_prefill_chunk=min_prefill_chunk,
    )
    fake = FakeExecutor.for_config(core.config)
    turn = list(range(100, 124))
    params = SamplingParams(max_tokens=1)
    core.add_request(turn, params, CollectingSink(), request_id="turn1")
    while core.has_work:
        step(core, fake)
    add(core, "long", 40, max_tokens=1)
    chunks = []
    while core.has_work:
        chunks += [item.num_tokens for item in step(core, fake).batch.requests]
    # The next turn: the first one's 24 computed tokens (its sample is never computed).
    nxt = core.add_request([*turn, 1, 2, 3, 4], params, CollectingSink(), request_id="turn2")
    core.plan()
    return chunks, nxt.num_cached_tokens


def test_a_short_chunk_spares_a_kept_prefix_in_a_window_pool() -> None:
    """With sliding-window groups a prefill chunk holds a window's pages more during its step
    than after it; where pages nobody keeps are too few for that, the planner runs a
    shorter chunk rather than evict a chat's kept prefix, and the chat's next turn hits."""
    spared_chunks, spared_hit = _chat_then_long_prompt(min_prefill_chunk=8)
    whole_chunks, whole_hit = _chat_then_long_prompt(min_prefill_chunk=64)
    assert whole_chunks == [40] and whole_hit == 0  # one chunk: the prefix was evicted
    assert spared_chunks == [20, 10, 10] and spared_hit == 24


def test_full_attention_chunks_are_never_shortened_to_spare_prefixes() -> None:
    """Where every group keeps every block a shorter chunk would only delay the eviction."""
    core = make_core(num_blocks=20, min_prefill_chunk=4)
    fake = FakeExecutor.for_config(core.config)
    add(core, "a", 32, max_tokens=1)
    while core.has_work:
        step(core, fake)
    add(core, "b", 40, max_tokens=1)
    assert [item.num_tokens for item in core.plan().batch.requests] == [40]
