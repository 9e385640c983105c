"""A user's policy, written by subclassing in this file only: StreamingLLM sink + window.

The allocator, prefix caching and release of the middle blocks must all work for it with
no change to hybridkv.memory.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import pytest

from hybridkv.memory import KVCacheManager
from hybridkv.policies import FullAttention, MemoryPolicy, Span, make_policy, register_policy
from hybridkv.policies.base import positive


@register_policy
@attrs.frozen
class SinkWindow(MemoryPolicy):
    """Keep the first ``sinks`` tokens and the last ``window`` tokens (StreamingLLM)."""

    name: ClassVar[str] = "test_sink_window"
    sinks: int = attrs.field(validator=positive)
    window: int = attrs.field(validator=positive)

    def live_spans(self, num_tokens: int) -> tuple[Span, ...]:
        start = max(0, num_tokens - self.window + 1)
        if start <= self.sinks:
            return ((0, num_tokens),) if num_tokens else ()
        return ((0, self.sinks), (start, num_tokens))


POLICY = SinkWindow(sinks=4, window=5)


def test_the_subclass_is_registered_by_name() -> None:
    """register_policy makes a user's class constructible from a config name."""
    assert make_policy("test_sink_window", sinks=4, window=5) == POLICY


def test_middle_blocks_are_released_and_sinks_kept(make_request) -> None:
    """As the window slides, middle blocks become null; the sink block stays."""
    mgr = KVCacheManager([FullAttention(), POLICY], num_blocks=30, block_size=4)
    req = make_request("r", list(range(16)))
    mgr.allocate(req, 16, mgr.lookup(req))
    for token in range(4):
        req.all_token_ids.append(100 + token)
        mgr.allocate(req, 1)
    # computing position 19: live [0, 4) and [15, 19) -> blocks 0, 3, 4
    assert mgr.block_tables("r")[1] == [5, 0, 0, 8, 10]
    mgr.check_integrity()


def test_prefix_hit_needs_only_sinks_and_window(make_request) -> None:
    """A hit resumes when the sink and window blocks are cached, the middle evicted."""
    mgr = KVCacheManager([POLICY], num_blocks=9, block_size=4)
    a = make_request("a", list(range(20)))
    mgr.allocate(a, 8, mgr.lookup(a))
    mgr.allocate(a, 8)
    mgr.allocate(a, 4)  # blocks 1 and 2 die: pages 3 and 2 are released, still cached
    mgr.free("a")  # free queue: 6 7 8 | 3 2 5 4 1 (unhashed | cached, oldest first)
    filler = make_request("x", [9] * 20)
    mgr.allocate(filler, 20)  # takes 6 7 8 3 2: the middle blocks are evicted
    b = make_request("b", [*range(20), 1])
    hit = mgr.lookup(b)
    assert hit.num_tokens == 20
    assert hit.block_tables == ((1, 0, 0, 0, 5),)  # live at 20: sinks [0, 4) and window [16, 20)
    assert mgr.allocate(b, 1, hit) == ([4],)
    mgr.check_integrity()


@pytest.mark.parametrize("n", range(0, 40, 3))
def test_live_spans_keep_the_no_resurrection_invariant(n: int) -> None:
    """A position dead at n is dead at every later n."""
    live = {p for a, b in POLICY.live_spans(n) for p in range(a, b)}
    for later in range(n, n + 20):
        later_live = {p for a, b in POLICY.live_spans(later) for p in range(a, b)}
        assert later_live <= live | set(range(n, later))


@pytest.mark.parametrize("block_size", [1, 3, 4, 8])
def test_generic_max_live_blocks_finds_the_peak_before_the_end(block_size: int) -> None:
    """A sink + window request holds most blocks mid-way; the generic bound finds that peak."""
    policy = SinkWindow(sinks=4, window=6)
    for n in range(1, 70):
        peak = max(sum(b - a for a, b in policy.live_block_spans(p, block_size)) for p in range(n))
        assert policy.max_live_blocks(n, block_size) == peak, n


def test_attention_follows_the_live_spans() -> None:
    """A user's policy names no window, so attention is masked by its live spans."""
    assert POLICY.attention_window() is None
