"""The eviction order: the kept prefix whose next resume is predicted farthest goes first."""

from __future__ import annotations

from hybridkv.memory import BlockHash
from hybridkv.memory.eviction_order import EvictionOrder, KeptPrefix


def prefix(name: str) -> KeptPrefix:
    return KeptPrefix([BlockHash(name.encode())], [1], num_blocks=1, num_groups=0, is_branch=False)


def kept_at(order: EvictionOrder, clock: int, name: str) -> KeptPrefix:
    order.clock = clock
    p = prefix(name)
    order.add(p)
    return p


def resumed_at(order: EvictionOrder, clock: int, p: KeptPrefix) -> None:
    """A request resumes ``p`` at ``clock`` and ends at once."""
    order.clock = clock
    order.resume(p)
    order.release(p)


def test_a_prefix_never_resumed_goes_newest_first() -> None:
    """With no reuse seen, the newest prefix is expected farthest off: a loop of sessions
    larger than the pool keeps its oldest part instead of losing each one just before its
    turn (least recently used's worst case)."""
    order = EvictionOrder(horizon=100)
    old, new = kept_at(order, 0, "old"), kept_at(order, 10, "new")
    assert order.victim() is new
    order.remove(new)
    assert order.victim() is old
    order.check_integrity()


def test_the_prefix_resumed_farthest_in_the_future_goes_first() -> None:
    """Last use plus the measured reuse distance predicts the next resume."""
    order = EvictionOrder(horizon=1000)
    often, seldom = kept_at(order, 0, "often"), kept_at(order, 0, "seldom")
    resumed_at(order, 400, seldom)  # reused after 400 pages: next expected at 800
    resumed_at(order, 500, often)  # after 500, but used later: ...
    resumed_at(order, 520, often)  # ... then after 20: next expected at 540
    assert order.victim() is seldom
    assert order.predicted_resume(often) == 540 and order.predicted_resume(seldom) == 800


def test_a_prefix_never_resumed_goes_before_one_reused_at_the_same_time() -> None:
    """One never resumed is expected no sooner than the longest reuse seen."""
    order = EvictionOrder(horizon=10)
    reused = kept_at(order, 0, "reused")
    resumed_at(order, 300, reused)  # distance 300, more than the pool (10)
    fresh = kept_at(order, 300, "fresh")
    assert order.victim() is fresh


def test_a_prefix_idle_twice_the_longest_reuse_is_stale_and_goes_first() -> None:
    """An abandoned conversation does not outlive the ones still awaited."""
    order = EvictionOrder(horizon=100)
    abandoned = kept_at(order, 0, "abandoned")
    resumed_at(order, 50, abandoned)  # distance 50: expected back at 100
    awaited = kept_at(order, 60, "awaited")
    resumed_at(order, 90, awaited)  # distance 30: expected back at 120
    order.clock = 120
    assert order.victim() is awaited  # farthest off: 120 against 100
    order.clock = 151  # idle 101 > 2 x 50, the longest reuse seen
    assert order.victim() is abandoned


def test_a_pinned_prefix_goes_only_when_no_other_is_left() -> None:
    """A prefix a running request resumed holds pages in use: giving it up frees nothing."""
    order = EvictionOrder(horizon=100)
    pinned, idle = kept_at(order, 0, "pinned"), kept_at(order, 0, "idle")
    order.clock = 5
    order.resume(pinned)
    assert order.victim() is idle
    order.remove(idle)
    assert order.victim() is pinned
    order.release(pinned)
    assert pinned.num_pins == 0 and order.victim() is pinned
    order.check_integrity()


def test_the_heap_stays_exact_through_many_uses() -> None:
    """Uses leave outdated heap entries behind; rebuilds keep the order exact."""
    order = EvictionOrder(horizon=100)
    prefixes = [kept_at(order, k, f"p{k}") for k in range(8)]
    for step in range(500):
        resumed_at(order, 10 + step, prefixes[step % 7])  # all but p7 are reused
    order.check_integrity()
    assert order.victim() is prefixes[7]  # never resumed
    order.remove(prefixes[7])
    latest = max(prefixes[:7], key=order.predicted_resume)
    assert order.victim() is latest


def test_a_conversation_back_after_eviction_tells_its_reuse_distance() -> None:
    """Evicted prefixes are remembered by key: a request that comes back to one measures
    the reuse distance, and prefixes idle twice that long turn stale."""
    order = EvictionOrder(horizon=1000)
    abandoned = kept_at(order, 0, "abandoned")
    new = kept_at(order, 50, "new")
    assert order.victim() is new  # neither resumed yet: the newer one goes
    order.remove(new)
    order.remember(new)
    recent = kept_at(order, 70, "recent")
    order.clock = 80
    assert order.victim() is recent  # no reuse seen yet: nothing is stale
    assert order.recall([BlockHash(b"system"), BlockHash(b"new"), BlockHash(b"turn 2")]) == 30
    assert order.recall([BlockHash(b"new")]) == 0  # forgotten once recalled
    assert order.victim() is abandoned  # idle 80 > 2 x 30: its conversation is over
