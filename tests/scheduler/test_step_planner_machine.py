"""Hypothesis: any sequence of arrivals, steps, failures and aborts keeps the invariants.

The machine drives the engine core with a small pool (so preemption is frequent), a small
token budget (so prompts are chunked) and shared prefixes (so prefix hits happen), checks
every planned step against the limits, and at the end checks every output against the
fake model run without any cache.
"""

from __future__ import annotations

from typing import ClassVar

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv.memory.errors import PromptTooLongError
from hybridkv.policies import (
    ChunkedLocal,
    FullAttention,
    MambaLike,
    MemoryPolicy,
    SlidingWindow,
    cdiv,
)
from hybridkv.scheduler import EngineConfig, FinishReason, RequestOutput, SamplingParams
from hybridkv.scheduler.core import EngineCore
from hybridkv.scheduler.errors import EngineOverloadedError, RequestFailedError
from hybridkv.scheduler.fake import CollectingSink, FakeExecutor, reference_tokens
from hybridkv.scheduler.request import RequestStatus
from hybridkv.scheduler.step_planner import StepPlan

VOCAB = 50
PREFIXES = ([11] * 9, [12, 13] * 6)


class PlannerMachine(RuleBasedStateMachine):
    POLICIES: ClassVar[tuple[MemoryPolicy, ...]] = (FullAttention(), SlidingWindow(window=6))

    def __init__(self) -> None:
        super().__init__()
        self.config = EngineConfig(
            policies=self.POLICIES,
            num_blocks=29,
            block_size=4,
            max_model_len=48,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            max_prefill_chunk=12,
            max_waiting=6,
            vocab_size=VOCAB,
            scheduling_policy="priority",
        )
        self.core = EngineCore(self.config)
        self.fake = FakeExecutor.for_config(self.config)
        self.requests: dict[str, tuple[list[int], SamplingParams, CollectingSink]] = {}

    @rule(
        prompt_len=st.integers(1, 30),
        max_tokens=st.integers(1, 12),
        priority=st.integers(0, 2),
        prefix=st.sampled_from([None, 0, 1]),
        parent=st.sampled_from([None, None, "p", "q"]),  # copies of one request
    )
    def arrive(
        self,
        prompt_len: int,
        max_tokens: int,
        priority: int,
        prefix: int | None,
        parent: str | None,
    ) -> None:
        rid = str(len(self.requests))
        own = [(len(self.requests) * 7 + i) % VOCAB for i in range(prompt_len)]
        prompt = (PREFIXES[prefix] if prefix is not None else []) + own
        params = SamplingParams(max_tokens=max_tokens, parent_id=parent)
        sink = CollectingSink()
        try:
            self.core.add_request(prompt, params, sink, request_id=rid, priority=priority)
        except (PromptTooLongError, EngineOverloadedError):
            return
        self.requests[rid] = (prompt, params, sink)

    @precondition(lambda self: self.core.has_work)
    @rule(mishap=st.sampled_from(["none"] * 6 + ["abort_in_step", "fail"]))
    def step(self, mishap: str) -> None:
        plan = self.core.plan()
        self.check_plan(plan)
        if mishap == "abort_in_step" and plan.scheduled:
            self.core.abort(plan.scheduled[-1].request_id)
        if mishap == "fail":
            self.core.fail(plan, RuntimeError("step failed"))
        else:
            self.core.apply(plan, self.fake.execute(plan.batch))
        self.core.flush()

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = [r.request_id for r in self.core.running] + [r.request_id for r in self.core.waiting]
        if live:
            self.core.abort(data.draw(st.sampled_from(sorted(live))))

    def check_plan(self, plan: StepPlan) -> None:
        config, bs = self.config, self.config.block_size
        items = plan.batch.requests
        assert len(items) == len(plan.scheduled)
        assert plan.num_tokens == sum(item.num_tokens for item in items)
        assert plan.num_tokens <= config.max_num_batched_tokens
        assert len({item.request_id for item in items}) == len(items)
        assert not (plan.preempted and plan.admitted)
        for request, item in zip(plan.scheduled, items, strict=True):
            tokens = request.all_token_ids
            start, end = item.start_position, item.start_position + item.num_tokens
            # Proposed tokens (speculative decoding) follow the request's own.
            own = item.num_tokens - item.num_draft_tokens
            assert request.in_step and request.status is RequestStatus.RUNNING
            assert item.request_id == request.request_id
            assert 1 <= own <= config.prefill_chunk
            assert start == request.num_computed_tokens and start + own <= len(tokens)
            assert list(item.token_ids[:own]) == tokens[start : start + own]
            assert item.sample == (start + own == len(tokens))
            if item.num_draft_tokens:
                assert own == 1 and end < config.max_model_len
                assert len(tokens) + item.num_draft_tokens <= (
                    request.num_prompt_tokens + request.params.max_tokens
                )
            for table, policy in zip(item.block_tables, config.policies, strict=True):
                assert len(table) >= cdiv(end, bs)
                # A state group's step needs a page where it ends (memory/state_pages.py).
                written = range(end - 1, end) if policy.keeps_state else range(start, end)
                assert all(table[p // bs] for p in written)

    @invariant()
    def queues_and_pool_are_consistent(self) -> None:
        core = self.core
        core.kv.check_integrity()
        running = [r for r in core.running if r.status is RequestStatus.RUNNING]
        assert len(running) <= self.config.max_num_seqs
        keys = [(r.priority, r.arrival_seq) for r in running]
        assert keys == sorted(keys)
        waiting = list(core.waiting)
        assert len(waiting) == len(core.waiting)
        assert not {id(r) for r in running} & {id(r) for r in waiting}
        for parent in ("p", "q"):  # one request's copies hold at most their share
            copies = [r for r in running if r.params.parent_id == parent]
            assert len(copies) <= self.config.max_copies_running
        if not running and not any(r.in_step for r in core.running):
            assert core.kv.num_free_blocks == core.kv.num_usable_blocks

    def teardown(self) -> None:
        for _ in range(2000):
            if not self.core.has_work:
                break
            plan = self.core.plan()
            self.check_plan(plan)
            self.core.apply(plan, self.fake.execute(plan.batch))
            self.core.flush()
        assert not self.core.has_work
        assert self.core.kv.num_free_blocks == self.core.kv.num_usable_blocks
        for prompt, params, sink in self.requests.values():
            assert sink.is_closed
            outputs = [o for o in sink.items if isinstance(o, RequestOutput)]
            got = [t for o in outputs for t in o.new_token_ids]
            assert got == reference_tokens(prompt, len(got), VOCAB)
            last = sink.items[-1]
            if isinstance(last, RequestFailedError):
                continue
            assert last.finish_reason is not None and list(last.token_ids) == got
            if last.finish_reason is FinishReason.LENGTH:
                assert len(got) == min(params.max_tokens, self.config.max_model_len - len(prompt))


class RecurrentPlannerMachine(PlannerMachine):
    """The same machine over mamba-like, chunked-local and full groups."""

    POLICIES = (MambaLike(), ChunkedLocal(chunk=5), FullAttention())


TestPlannerMachine = PlannerMachine.TestCase
TestPlannerMachine.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)
TestRecurrentPlannerMachine = RecurrentPlannerMachine.TestCase
TestRecurrentPlannerMachine.settings = TestPlannerMachine.settings
