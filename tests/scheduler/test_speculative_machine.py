"""Hypothesis: speculative decoding under arrivals, chunking, hits, preemption, aborts and
failed steps keeps every invariant, and never caches or reads a rejected token.

The planner machine of ``test_step_planner_machine.py`` with speculation on: a proposer
that knows the fake's continuation gets a share of it wrong, so every step verifies a
random mix of accepted and rejected tokens. The fake fails a step that reads a state page
holding any other state than the one after exactly the tokens it resumes from, and a K/V
page whose hash was written by a rejected token changes the output of every request that
reads it; the teardown checks each output against the fake run without any cache.
"""

from __future__ import annotations

import attrs
from hypothesis import settings

from hybridkv.policies import FullAttention, MambaLike, SlidingWindow
from hybridkv.scheduler.core import EngineCore
from hybridkv.scheduler.fake import FakeExecutor
from hybridkv.scheduler.speculation import SpeculativeConfig
from hybridkv.testing import ReferenceProposer

from .test_step_planner_machine import VOCAB, PlannerMachine, RecurrentPlannerMachine


class _Speculating:
    """Turns a planner machine's speculation on (a mixin: first in the bases)."""

    STATE_SPAN = 1

    def __init__(self) -> None:
        super().__init__()
        machine: PlannerMachine = self  # type: ignore[assignment]
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=5, adaptive=False)
        span = self.STATE_SPAN
        machine.config = attrs.evolve(
            machine.config,
            speculative_config=spec,
            state_span=span,
            num_blocks=-(-machine.config.num_blocks // span) * span,
        )
        self.proposer = ReferenceProposer(VOCAB, miss=0.25, seed=len(machine.config.policies))
        machine.core = EngineCore(machine.config, proposer=self.proposer)
        machine.fake = FakeExecutor.for_config(machine.config)

    def teardown(self) -> None:
        super().teardown()  # type: ignore[misc]
        core: EngineCore = self.core  # type: ignore[attr-defined]
        stats = core.speculator.stats() if core.speculator else None
        assert stats is not None and stats.num_accepted_tokens <= stats.num_draft_tokens
        TALLY[0] += stats.num_draft_tokens
        TALLY[1] += stats.num_accepted_tokens


#: Proposed and accepted tokens over every example (the machines must exercise both).
TALLY = [0, 0]


class SpeculativePlannerMachine(_Speculating, PlannerMachine):
    """Full attention and a sliding window."""


class SpeculativeRecurrentMachine(_Speculating, RecurrentPlannerMachine):
    """Mamba-like, chunked-local and full groups."""


class SpeculativeSpansMachine(_Speculating, PlannerMachine):
    """State pages two page ids wide beside full attention and a window."""

    POLICIES = (MambaLike(), FullAttention(), SlidingWindow(window=6))
    STATE_SPAN = 2


TestSpeculativePlannerMachine = SpeculativePlannerMachine.TestCase
TestSpeculativeRecurrentMachine = SpeculativeRecurrentMachine.TestCase
TestSpeculativeSpansMachine = SpeculativeSpansMachine.TestCase
for case in (TestSpeculativePlannerMachine, TestSpeculativeRecurrentMachine):
    case.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)
TestSpeculativeSpansMachine.settings = TestSpeculativePlannerMachine.settings


def test_the_machines_verified_both_accepted_and_rejected_tokens() -> None:
    proposed, accepted = TALLY
    if not proposed:  # run alone: run one machine here
        TestSpeculativeRecurrentMachine("runTest").runTest()
        proposed, accepted = TALLY
    assert 0 < accepted < proposed, TALLY
