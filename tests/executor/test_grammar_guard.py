"""llguidance's check runs in a child process: a grammar that crashes or stalls it is a
GrammarError here, and the next check gets a fresh child."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from grammar_samples import chained_lark

from hybridkv.executor.grammar_bounds import GrammarLimits
from hybridkv.executor.grammar_guard import GrammarGuard
from hybridkv.executor.grammars import GrammarError
from hybridkv.scheduler.params import StructuredOutput

GOOD = StructuredOutput("grammar", 'start: "yes" | "no"')
#: Limits high enough to let through the chain that overflows llguidance's stack.
NO_LIMITS = GrammarLimits(max_grammar_bytes=1 << 24, max_rules=1 << 20, max_reference_depth=1 << 20)


@pytest.fixture
def guard() -> Iterator[GrammarGuard]:
    guard = GrammarGuard()
    yield guard
    guard.close()


def test_a_grammar_that_compiles_passes(guard: GrammarGuard) -> None:
    """A valid grammar passes, checked in a child process that stays up."""
    guard.check(GOOD)
    assert guard.is_running


def test_a_grammar_that_does_not_compile_is_refused(guard: GrammarGuard) -> None:
    """llguidance's refusal comes back as a GrammarError naming the kind."""
    with pytest.raises(GrammarError, match="the grammar does not compile"):
        guard.check(StructuredOutput("grammar", "start: undefined_rule"))


def test_verdicts_are_cached(guard: GrammarGuard) -> None:
    """A spec checked once is answered again without a child (``n`` copies, retries)."""
    bad = StructuredOutput("regex", "(unclosed")
    with pytest.raises(GrammarError):
        guard.check(bad)
    guard.check(GOOD)
    guard.close()
    with pytest.raises(GrammarError, match="does not compile"):
        guard.check(bad)
    guard.check(GOOD)
    assert not guard.is_running


def test_a_grammar_that_crashes_the_compiler_costs_only_the_child() -> None:
    """3,000 chained rules kill llguidance (a native stack overflow): the check says so,
    this process lives, and the next check runs in a new child."""
    guard = GrammarGuard(limits=NO_LIMITS)
    try:
        with pytest.raises(GrammarError, match="crashed the grammar compiler"):
            guard.check(StructuredOutput("grammar", chained_lark(3000)))
        assert not guard.is_running
        guard.check(GOOD)
        assert guard.is_running
    finally:
        guard.close()


def test_a_check_past_its_deadline_is_refused_and_the_child_replaced() -> None:
    """A check with no answer within ``timeout_s`` is refused naming the time (0 s: the
    child just started cannot have answered), and the stuck child is killed."""
    guard = GrammarGuard(timeout_s=0)
    try:
        with pytest.raises(GrammarError, match="did not compile within 0 s"):
            guard.check(GOOD)
        assert not guard.is_running
    finally:
        guard.close()
