"""The steps in flight: planned, handed to the executor, not yet applied or failed.

With pipeline stages the core plans a step while earlier ones run, so steps form a
queue, applied (or failed) oldest first::

    plan() -> push(s3)        in flight: s1 s2 s3
    apply(s1) -> pop(s1)      in flight: s2 s3
    fail(s2) -> pop(s2)       in flight: s3, and s3's requests admitted on a prefix hit
                              are stale: the hit may name blocks s2 was to fill

A request is in at most one step in flight, and keeps its pages until that step returns.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from hybridkv.scheduler.batch import Executor
from hybridkv.scheduler.config import ConfigError
from hybridkv.scheduler.request import Request
from hybridkv.scheduler.step_planner import StepPlan


class StepsInFlight:
    """The queue of steps in flight, and the requests a failed step made stale."""

    def __init__(self) -> None:
        self._plans: deque[StepPlan] = deque()
        self._stale: set[Request] = set()

    def __len__(self) -> int:
        return len(self._plans)

    def push(self, plan: StepPlan) -> None:
        """A planned step that runs something was handed to the executor."""
        self._plans.append(plan)

    def pop(self, plan: StepPlan) -> None:
        """``plan`` returned; it must be the oldest step in flight."""
        oldest = self._plans.popleft() if self._plans else None
        assert oldest is plan, "steps are applied (or failed) in the order they were planned"

    def failed(self) -> None:
        """The oldest step failed (and was popped): every later step's request that was
        admitted on a prefix hit may read blocks it was to fill, and fails on return."""
        for later in self._plans:
            self._stale.update(r for r in later.admitted if r.num_computed_tokens)

    @property
    def has_stale(self) -> bool:
        """Whether any request in flight must fail when its step returns."""
        return bool(self._stale)

    def take_stale(self, request: Request) -> bool:
        """Whether ``request`` was made stale by a failed step (forgotten once asked)."""
        if request in self._stale:
            self._stale.discard(request)
            return True
        return False

    def drain(self) -> Iterator[StepPlan]:
        """Every step in flight, oldest first, forgetting them (the executor stopped)."""
        self._stale.clear()
        while self._plans:
            yield self._plans.popleft()


def steps_in_flight(executor: Executor) -> int:
    """How many steps the executor takes at once (1 unless it is a PipelinedExecutor)."""
    depth = getattr(executor, "max_steps_in_flight", 1)
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ConfigError(f"executor.max_steps_in_flight must be an int >= 1, got {depth!r}")
    return depth
