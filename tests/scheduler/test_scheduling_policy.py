"""Scheduling rules on the engine core, without a loop: FCFS refuses priorities, priority
scheduling orders by them within a bounded range, and the copies of one request (its
``n``/``best_of`` choices) never hold more than their share of the running slots."""

from __future__ import annotations

import math
from typing import Any

import pytest

from hybridkv.policies import FullAttention
from hybridkv.scheduler import EngineConfig, InvalidRequestError, RequestOutput, SamplingParams
from hybridkv.scheduler.config import PRIORITY_MAX, PRIORITY_MIN, ConfigError
from hybridkv.scheduler.core import EngineCore
from hybridkv.scheduler.fake import CollectingSink, FakeExecutor, reference_tokens
from hybridkv.scheduler.request import Request, RequestStatus
from hybridkv.scheduler.step_planner import StepPlan

VOCAB = 50


def make_core(**options: Any) -> EngineCore:
    settings: dict[str, Any] = {
        "policies": [FullAttention()],
        "num_blocks": 257,
        "block_size": 4,
        "max_model_len": 128,
        "max_num_batched_tokens": 64,
        "vocab_size": VOCAB,
    }
    settings.update(options)
    return EngineCore(EngineConfig(**settings))


def add(
    core: EngineCore,
    rid: str,
    *,
    max_tokens: int = 4,
    priority: int = 0,
    parent: str | None = None,
    sink: CollectingSink | None = None,
) -> Request:
    prompt = [(sum(map(ord, rid)) + i) % VOCAB for i in range(6)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, parent_id=parent)
    return core.add_request(
        prompt, params, sink or CollectingSink(), request_id=rid, priority=priority
    )


def step(core: EngineCore, fake: FakeExecutor) -> StepPlan:
    plan = core.plan()
    core.apply(plan, fake.execute(plan.batch))
    core.flush()
    return plan


def ids(requests: Any) -> list[str]:
    return [r.request_id for r in requests]


# -- the policy ----------------------------------------------------------------------------


def test_fcfs_is_the_default_and_refuses_a_priority_at_add_time() -> None:
    """Under FCFS (the default) a priority other than 0 raises InvalidRequestError naming
    the policy, and nothing is queued; priority 0 is taken."""
    core = make_core()
    assert core.config.scheduling_policy == "fcfs"
    for priority in (-100, 1, -(10**99)):
        with pytest.raises(InvalidRequestError, match="scheduling_policy='fcfs'"):
            add(core, f"p{priority}", priority=priority)
    assert not core.has_work
    add(core, "zero", priority=0)
    assert len(core.waiting) == 1


def test_fcfs_serves_in_arrival_order() -> None:
    """Without priorities, admission is arrival order."""
    core = make_core(max_num_seqs=2)
    for rid in ("first", "second", "third"):
        add(core, rid)
    assert ids(core.plan().admitted) == ["first", "second"]


def test_priority_scheduling_orders_by_priority_then_arrival() -> None:
    """Lower priorities are admitted first, ties in arrival order; the range's ends are
    accepted."""
    core = make_core(max_num_seqs=4, scheduling_policy="priority")
    add(core, "late-low", priority=PRIORITY_MAX)
    add(core, "first")
    add(core, "urgent", priority=-100)
    add(core, "second")
    add(core, "most-urgent", priority=PRIORITY_MIN)
    assert ids(core.plan().admitted) == ["most-urgent", "urgent", "first", "second"]
    assert ids(core.waiting) == ["late-low"]


@pytest.mark.parametrize("priority", [PRIORITY_MAX + 1, PRIORITY_MIN - 1, -(10**99), 10**99])
def test_priority_scheduling_refuses_priorities_out_of_range(priority: int) -> None:
    """A priority outside the signed 64-bit range is refused at add time, message bounded."""
    core = make_core(scheduling_policy="priority")
    with pytest.raises(InvalidRequestError, match="signed 64-bit") as caught:
        add(core, "x", priority=priority)
    assert len(str(caught.value)) < 200
    assert not core.has_work


@pytest.mark.parametrize("priority", [1.5, True, "1"])
def test_a_priority_that_is_not_an_integer_is_refused(priority: Any) -> None:
    core = make_core(scheduling_policy="priority")
    with pytest.raises(InvalidRequestError, match="integer"):
        add(core, "x", priority=priority)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("scheduling_policy", "lifo"),
        ("max_running_share", 0),
        ("max_running_share", 1.5),
        ("max_running_share", math.nan),
        ("max_running_share", True),
    ],
)
def test_scheduling_settings_out_of_range_are_refused(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        make_core(**{field: value})


@pytest.mark.parametrize(
    ("max_num_seqs", "share", "expected"), [(32, 0.5, 16), (3, 0.5, 1), (1, 0.5, 1), (8, 1.0, 8)]
)
def test_copies_running_is_the_share_of_the_slots_rounded_down(
    max_num_seqs: int, share: float, expected: int
) -> None:
    core = make_core(max_num_seqs=max_num_seqs, max_running_share=share)
    assert core.config.max_copies_running == expected


# -- one request's copies ------------------------------------------------------------------


def test_copies_of_one_request_cannot_take_every_running_slot() -> None:
    """With 4 slots and a share of 0.5, 6 copies of one request run 2 at a time: a fresh
    request that arrived after all of them is admitted in the same step, while 4 copies
    still wait; every copy still finishes, with the tokens it would have had alone."""
    core = make_core(max_num_seqs=4, max_running_share=0.5)
    fake = FakeExecutor.for_config(core.config)
    sinks = {f"c{i}": CollectingSink() for i in range(6)}
    for rid, sink in sinks.items():
        add(core, rid, max_tokens=5, parent="p", sink=sink)
    fresh = CollectingSink()
    add(core, "fresh", max_tokens=2, sink=fresh)

    plan = step(core, fake)
    assert ids(plan.admitted) == ["c0", "c1", "fresh"]
    assert sorted(ids(core.waiting)) == ["c2", "c3", "c4", "c5"]

    for _ in range(100):
        if not core.has_work:
            break
        step(core, fake)
        running_copies = [r for r in core.running if r.params.parent_id == "p"]
        assert len(running_copies) <= 2
    assert not core.has_work
    assert fresh.is_closed and isinstance(fresh.items[-1], RequestOutput)
    for rid, sink in sinks.items():
        prompt = [(sum(map(ord, rid)) + i) % VOCAB for i in range(6)]
        tokens = [
            t for out in sink.items if isinstance(out, RequestOutput) for t in out.new_token_ids
        ]
        assert tokens == reference_tokens(prompt, 5, VOCAB)


def test_a_held_copy_keeps_its_place_in_the_queue() -> None:
    """A copy passed over for its parent's share is the first admitted once its parent
    has room, ahead of requests that arrived after it."""
    core = make_core(max_num_seqs=3, max_running_share=0.5)  # one copy at a time
    fake = FakeExecutor.for_config(core.config)
    c0 = add(core, "c0", max_tokens=2, parent="p")
    add(core, "c1", max_tokens=2, parent="p")
    add(core, "x", max_tokens=50)
    assert ids(step(core, fake).admitted) == ["c0", "x"]
    add(core, "y", max_tokens=50)
    # c0 takes its last token in this step: c1 is passed over once more, y fills up.
    assert ids(step(core, fake).admitted) == ["y"]
    assert c0.status is RequestStatus.FINISHED
    add(core, "z", max_tokens=1)
    assert ids(step(core, fake).admitted) == ["c1"]  # ahead of z, which came later
    assert ids(core.waiting) == ["z"]


def test_copies_of_different_parents_and_lone_requests_are_counted_apart() -> None:
    """Each parent has its own share; requests without a parent are not capped."""
    core = make_core(max_num_seqs=6, max_running_share=0.34)  # 2 copies per parent
    for i in range(3):
        add(core, f"a{i}", parent="a")
    for i in range(3):
        add(core, f"b{i}", parent="b")
    add(core, "solo")
    assert ids(core.plan().admitted) == ["a0", "a1", "b0", "b1", "solo"]
    assert sorted(ids(core.waiting)) == ["a2", "b2"]


def test_a_share_of_one_lets_one_request_take_every_slot() -> None:
    """max_running_share=1.0 turns the cap off, as before it existed."""
    core = make_core(max_num_seqs=4, max_running_share=1.0)
    for i in range(5):
        add(core, f"c{i}", parent="p")
    add(core, "fresh")
    assert ids(core.plan().admitted) == ["c0", "c1", "c2", "c3"]
    assert all(r.status is RequestStatus.WAITING for r in core.waiting)
