"""check_policy_laws: the built-in policies and a user's keep the laws; broken ones fail."""

from __future__ import annotations

from typing import ClassVar

import attrs
import pytest

from hybridkv.policies import (
    AttentionWindow,
    ChunkedLocal,
    CompressedEntries,
    FullAttention,
    MambaLike,
    MemoryPolicy,
    PolicyLawError,
    SlidingWindow,
    Span,
    check_policy_laws,
)
from hybridkv.policies.base import IsCached


@attrs.frozen
class SinkWindow(MemoryPolicy):
    """The guide's StreamingLLM policy: the first ``sinks`` tokens and the last window."""

    sinks: int
    window: int

    def live_spans(self, num_tokens: int) -> tuple[Span, ...]:
        start = max(0, num_tokens - self.window + 1)
        if start <= self.sinks:
            return ((0, num_tokens),) if num_tokens else ()
        return ((0, self.sinks), (start, num_tokens))


@pytest.mark.parametrize(
    "policy",
    [
        FullAttention(),
        SlidingWindow(window=7),
        ChunkedLocal(chunk=6),
        MambaLike(),
        MambaLike(checkpoint_every=3),
        SinkWindow(sinks=2, window=5),
    ],
)
def test_the_built_in_policies_and_a_users_keep_the_laws(policy: MemoryPolicy) -> None:
    check_policy_laws(policy, max_tokens=80)


@pytest.mark.parametrize("rate", [1, 4, 8])
def test_compressed_entries_keep_the_laws_at_the_block_sizes_they_take(rate: int) -> None:
    """At blocks a divisor or a multiple of the rate (the others are refused): entries
    in every block, or in one block of every few with the others left null."""
    check_policy_laws(CompressedEntries(rate=rate), max_tokens=80, block_sizes=(1, 2, 4, 8, 16))


@attrs.frozen
class Resurrecting(MemoryPolicy):
    """Every 10th count reads the first token again, after it had dropped it."""

    def live_spans(self, num_tokens: int) -> tuple[Span, ...]:
        if num_tokens % 10 == 0 and num_tokens:
            return ((0, 1), (num_tokens - 1, num_tokens)) if num_tokens > 1 else ((0, 1),)
        return ((num_tokens - 1, num_tokens),) if num_tokens else ()


@attrs.frozen
class WrongWindow(SlidingWindow):
    """Names a window one token wider than what it keeps."""

    def attention_window(self) -> AttentionWindow | None:
        return AttentionWindow(self.window + 1)


@attrs.frozen
class EagerRelease(SlidingWindow):
    """Says no block dies for ten blocks, while the window drops one every block: the
    allocator would skip its release scans past real deaths."""

    def next_release(self, num_tokens: int, block_size: int) -> int:
        return num_tokens + 10 * block_size


@attrs.frozen
class GreedyHit(FullAttention):
    """Claims a hit of every block asked for, cached or not."""

    def longest_hit(self, max_blocks: int, block_size: int, is_cached: IsCached) -> int:
        return max_blocks


@attrs.frozen
class Unsorted(MemoryPolicy):
    def live_spans(self, num_tokens: int) -> tuple[Span, ...]:
        return ((1, num_tokens), (0, 1)) if num_tokens > 1 else ()


@attrs.frozen
class TooFewBlocks(FullAttention):
    name: ClassVar[str] = "too_few"

    def max_live_blocks(self, num_tokens: int, block_size: int) -> int:
        return 1


@pytest.mark.parametrize(
    ("policy", "law"),
    [
        (Resurrecting(), "no resurrection.*position 0 is dead at 9 tokens and live at 10"),
        (WrongWindow(window=4), "attention_window"),
        (EagerRelease(window=4), "next_release must not skip"),
        (GreedyHit(), "longest_hit"),
        (Unsorted(), "sorted, disjoint"),
        (TooFewBlocks(), "max_live_blocks must not undercount"),
    ],
)
def test_a_broken_law_is_named(policy: MemoryPolicy, law: str) -> None:
    with pytest.raises(PolicyLawError, match=law):
        check_policy_laws(policy, max_tokens=40)
