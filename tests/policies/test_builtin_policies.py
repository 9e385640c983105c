"""Built-in policies: live spans, derived block arithmetic, validation and the registry."""

from __future__ import annotations

import pytest

from hybridkv.policies import (
    AttentionWindow,
    ChunkedLocal,
    CompressedEntries,
    FullAttention,
    MambaLike,
    PolicyError,
    SlidingWindow,
    make_policy,
    policy_names,
)


def test_live_spans_follow_the_design_table() -> None:
    """Each policy's live tokens for position 10 match the table of docs/architecture.md."""
    assert FullAttention().live_spans(10) == ((0, 10),)
    assert SlidingWindow(window=5).live_spans(10) == ((6, 10),)
    assert ChunkedLocal(chunk=4).live_spans(10) == ((8, 10),)
    assert MambaLike().live_spans(10) == ((9, 10),)
    assert FullAttention().live_spans(0) == ()


def test_live_blocks_add_the_write_block() -> None:
    """The block position n is written into is always held (bs=4, W=5, n=10 -> [1, 3))."""
    assert SlidingWindow(window=5).live_block_spans(10, 4) == ((1, 3),)
    assert SlidingWindow(window=1).live_block_spans(8, 4) == ((2, 3),)
    assert MambaLike().live_block_spans(8, 4) == ((1, 3),)


@pytest.mark.parametrize(
    "policy",
    [
        FullAttention(),
        SlidingWindow(window=7),
        ChunkedLocal(chunk=6),
        CompressedEntries(rate=8),
        MambaLike(),
    ],
)
def test_next_release_never_skips_a_death(policy) -> None:  # type: ignore[no-untyped-def]
    """No block live at n is dead before the count next_release(n) returns."""
    bs = 4
    for n in range(60):
        held = {i for a, b in policy.live_block_spans(n, bs) for i in range(a, b)}
        for later in range(n + 1, min(policy.next_release(n, bs), 200)):
            alive = {i for a, b in policy.live_block_spans(later, bs) for i in range(a, b)}
            assert {i for i in held if i < later // bs} <= alive, (n, later)


@pytest.mark.parametrize(
    "policy", [SlidingWindow(window=7), ChunkedLocal(chunk=6), MambaLike(), FullAttention()]
)
def test_fast_hit_search_equals_the_generic_one(policy) -> None:  # type: ignore[no-untyped-def]
    """An overridden longest_hit agrees with the generic downward search on every cache."""
    from hybridkv.policies.base import MemoryPolicy

    for mask in range(1 << 7):
        cached = [bool(mask >> i & 1) for i in range(7)]
        fast = policy.longest_hit(7, 4, cached.__getitem__)
        slow = MemoryPolicy.longest_hit(policy, 7, 4, cached.__getitem__)
        assert fast == slow, (cached, fast, slow)


def test_max_live_blocks_bounds_window_requests() -> None:
    """A window of W tokens holds at most cdiv(W-1, bs) + 1 blocks."""
    assert SlidingWindow(window=5).max_live_blocks(1000, 4) == 2
    assert SlidingWindow(window=6).max_live_blocks(1000, 4) == 3
    assert FullAttention().max_live_blocks(10, 4) == 3


def _peak_blocks(policy, num_tokens: int, bs: int) -> int:  # type: ignore[no-untyped-def]
    return max(
        sum(stop - start for start, stop in policy.live_block_spans(q, bs))
        for q in range(num_tokens)
    )


def test_chunked_local_max_live_blocks_never_undercounts() -> None:
    """ChunkedLocal's bound is at least the most blocks any position before n holds."""
    for chunk in range(1, 13):
        for bs in range(1, 9):
            policy = ChunkedLocal(chunk=chunk)
            for n in range(1, 60):
                assert policy.max_live_blocks(n, bs) >= _peak_blocks(policy, n, bs), (chunk, bs, n)


def test_chunked_local_max_live_blocks_is_tight_for_long_requests() -> None:
    """For a long request the bound equals the peak (chunk 5, bs 4: two blocks, not three)."""
    assert ChunkedLocal(chunk=5).max_live_blocks(1000, 4) == 2
    for chunk in range(1, 13):
        for bs in range(1, 9):
            policy = ChunkedLocal(chunk=chunk)
            assert policy.max_live_blocks(200, bs) == _peak_blocks(policy, 200, bs), (chunk, bs)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_parameters_are_validated(bad) -> None:  # type: ignore[no-untyped-def]
    """A window or chunk below 1 (or not an integer) is rejected, naming the value."""
    with pytest.raises(PolicyError, match="window must be an integer >= 1"):
        SlidingWindow(window=bad)


def test_policies_are_immutable_values() -> None:
    """Policies are frozen and compare by value, so groups can be keyed by them."""
    assert SlidingWindow(window=4) == SlidingWindow(window=4)
    assert len({SlidingWindow(window=4), SlidingWindow(window=4), FullAttention()}) == 2
    with pytest.raises(AttributeError):
        SlidingWindow(window=4).window = 5  # type: ignore[misc]


def test_registry_builds_policies_by_name() -> None:
    """Config names map to the built-in classes."""
    assert {"full", "sliding_window", "chunked_local", "mamba"} <= set(policy_names())
    assert make_policy("sliding_window", window=8) == SlidingWindow(window=8)


def test_registry_errors_name_the_problem() -> None:
    """Unknown names and wrong parameters raise PolicyError with the name."""
    with pytest.raises(PolicyError, match="unknown memory policy 'paged'"):
        make_policy("paged")
    with pytest.raises(PolicyError, match="bad parameters for policy 'full'"):
        make_policy("full", window=3)


def _held_peak(policy, num_tokens: int, bs: int) -> int:  # type: ignore[no-untyped-def]
    """Brute force: the most blocks held while computing any position below num_tokens."""
    return max(
        sum(b - a for a, b in policy.live_block_spans(p, bs)) for p in range(max(num_tokens, 1))
    )


@pytest.mark.parametrize(
    "policy",
    [FullAttention(), SlidingWindow(window=7), SlidingWindow(window=1), ChunkedLocal(chunk=5)],
)
@pytest.mark.parametrize("bs", [1, 3, 4, 16])
def test_max_live_blocks_bounds_the_peak_tightly(policy, bs: int) -> None:  # type: ignore[no-untyped-def]
    """Each built-in admission bound never undercounts, and is exact for long requests."""
    for n in range(1, 90):
        bound, peak = policy.max_live_blocks(n, bs), _held_peak(policy, n, bs)
        assert bound >= peak, n
        assert bound == peak or n < 40, n


def test_mamba_max_live_blocks_bounds_the_peak() -> None:
    """MambaLike's two pages (state plus the one being written) bound every position."""
    for n in range(1, 60):
        assert MambaLike().max_live_blocks(n, 4) >= _held_peak(MambaLike(), n, 4)


@pytest.mark.parametrize(
    "policy", [FullAttention(), SlidingWindow(window=1), SlidingWindow(window=7), ChunkedLocal(5)]
)
def test_attention_window_agrees_with_live_spans(policy) -> None:  # type: ignore[no-untyped-def]
    """A window override names exactly the keys live_spans(p) and p give, at every p."""
    from hybridkv.policies.base import MemoryPolicy

    window = policy.attention_window()
    if window is None:
        assert MemoryPolicy.attention_window(policy) is None
        return
    for p in range(300):
        read = {k for a, b in policy.live_spans(p) for k in range(a, b)} | {p}
        first = 0 if window.size is None else max(0, p - window.size + 1)
        assert read == set(range(first, p + 1)), (p, window)


def test_builtin_windows_take_the_fast_path() -> None:
    """Full attention and sliding windows name their window; others use live spans."""
    assert FullAttention().attention_window() == AttentionWindow(None)
    assert SlidingWindow(window=7).attention_window() == AttentionWindow(7)
    assert ChunkedLocal(chunk=5).attention_window() is None
    assert MambaLike().attention_window() is None


@pytest.mark.parametrize(
    ("rate", "positions", "pages"), [(4, 4, None), (16, 1, None), (32, 1, [1, 3])]
)
def test_compressed_entries_keep_an_entry_a_rate_of_tokens(
    rate: int, positions: int, pages: list[int] | None
) -> None:
    """A page of 16 tokens holds the entries they complete (4 of rate 4), or one entry of
    a rate spanning blocks, in the block of its last token alone; the last token of each
    complete entry stays live for good."""
    policy = CompressedEntries(rate=rate)
    assert policy.page_positions(16) == positions
    assert policy.page_blocks(0, 64, 16) == pages
    assert policy.live_spans(2 * rate + 1) == ((rate - 1, rate), (2 * rate - 1, 2 * rate))
    assert policy.attention_window() is None


def test_a_rate_the_block_size_does_not_divide_or_multiply_is_refused() -> None:
    with pytest.raises(PolicyError, match="multiple or a divisor"):
        CompressedEntries(rate=6).page_positions(16)
