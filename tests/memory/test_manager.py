"""The KV cache manager: exact tables, hits, releases and all-or-nothing allocation."""

from __future__ import annotations

import pytest

from hybridkv.memory import KVCacheManager, StaleHitError
from hybridkv.policies import ChunkedLocal, FullAttention, MambaLike, SlidingWindow

FULL = FullAttention()


def admit(mgr: KVCacheManager, req, num_tokens: int | None = None):  # type: ignore[no-untyped-def]
    """Look up and allocate a request's whole prompt (or ``num_tokens`` of it)."""
    hit = mgr.lookup(req)
    todo = len(req.all_token_ids) - hit.num_tokens if num_tokens is None else num_tokens
    return hit, mgr.allocate(req, todo, hit)


def decode(mgr: KVCacheManager, req, token: int):  # type: ignore[no-untyped-def]
    """Append one sampled token and allocate its slot."""
    req.all_token_ids.append(token)
    return mgr.allocate(req, 1)


def test_full_attention_takes_a_page_per_block_and_none_within_a_block(make_request) -> None:
    """Decode steps inside the last block take no page; crossing a boundary takes one."""
    mgr = KVCacheManager([FULL], num_blocks=10, block_size=4)
    req = make_request("r", list(range(6)))
    _, new = admit(mgr, req)
    assert new == ([1, 2],)
    assert decode(mgr, req, 100) == ()  # position 6
    assert decode(mgr, req, 101) == ()  # position 7 fills block 1
    assert decode(mgr, req, 102) == ([3],)
    assert mgr.block_tables("r") == [[1, 2, 3]]
    mgr.check_integrity()


def test_sliding_window_releases_blocks_as_the_window_slides(make_request) -> None:
    """With W=5, bs=4, the block before the window becomes null and returns to the pool."""
    mgr = KVCacheManager([FULL, SlidingWindow(window=5)], num_blocks=20, block_size=4)
    req = make_request("r", list(range(10)))
    admit(mgr, req)
    assert mgr.block_tables("r") == [[1, 2, 3], [4, 5, 6]]
    decode(mgr, req, 50)  # computing position 10: window reads [6, 10) -> block 0 dead
    assert mgr.block_tables("r") == [[1, 2, 3], [0, 5, 6]]
    decode(mgr, req, 51)
    decode(mgr, req, 52)  # position 12: window [8, 12) -> block 1 dead, block 3 new
    assert mgr.block_tables("r") == [[1, 2, 3, 7], [0, 0, 6, 8]]
    assert mgr.usage().blocks_used_per_group == (4, 2)
    mgr.check_integrity()


def test_two_windows_release_at_their_own_pace(make_request) -> None:
    """A short and a long window in one request keep different live blocks."""
    mgr = KVCacheManager([SlidingWindow(window=2), SlidingWindow(window=9)], 30, 4)
    req = make_request("r", list(range(12)))
    admit(mgr, req)
    decode(mgr, req, 7)  # position 12: W=2 reads [11,12) -> block 2; W=9 reads [4,12)
    assert mgr.block_tables("r") == [[0, 0, 3, 7], [0, 5, 6, 8]]
    mgr.check_integrity()


def test_mamba_keeps_the_last_boundary_state_plus_the_one_being_written(make_request) -> None:
    """A mamba group holds the state at its last block boundary and the page being written;
    a prefill takes no page for blocks it leaves no state in (block 0 of 9 tokens)."""
    mgr = KVCacheManager([FULL, MambaLike()], num_blocks=20, block_size=4)
    req = make_request("r", list(range(9)))
    admit(mgr, req)
    assert mgr.block_tables("r") == [[1, 2, 3], [0, 4, 5]]
    decode(mgr, req, 70)  # position 9: the prefix of 2 blocks resumes from block 1's state
    assert mgr.block_tables("r") == [[1, 2, 3], [0, 4, 5]]
    for token in (71, 72, 73):  # position 12: block 2's state is the boundary's now
        decode(mgr, req, token)
    assert mgr.block_tables("r") == [[1, 2, 3, 6], [0, 0, 5, 7]]
    mgr.check_integrity()


def test_mamba_checkpoints_every_k_blocks_when_asked(make_request) -> None:
    """With checkpoint_every=2 a prefill of 21 tokens also keeps blocks 1 and 3's states."""
    mgr = KVCacheManager([MambaLike(checkpoint_every=2)], num_blocks=20, block_size=4)
    admit(mgr, make_request("r", list(range(21))))
    assert [i for i, page in enumerate(mgr.block_tables("r")[0]) if page] == [1, 3, 4, 5]
    mgr.check_integrity()


def test_shared_prefix_pages_are_reference_counted(make_request) -> None:
    """A second request with the same prefix takes the first one's pages."""
    mgr = KVCacheManager([FULL], num_blocks=10, block_size=4)
    a = make_request("a", list(range(10)))
    admit(mgr, a)
    b = make_request("b", [*range(8), 77, 78, 79])
    hit, new = admit(mgr, b)
    assert hit.num_tokens == 8 and new == ([4],)
    assert mgr.block_tables("b") == [[1, 2, 4]]
    assert [mgr.pool.ref_count(p) for p in (1, 2, 3, 4)] == [2, 2, 1, 1]
    mgr.free("a")
    assert [mgr.pool.ref_count(p) for p in (1, 2, 3, 4)] == [1, 1, 0, 1]
    assert mgr.usage().prefix_hit_tokens == 8
    mgr.check_integrity()


def test_a_hit_always_leaves_one_token_to_compute(make_request) -> None:
    """A prompt whose every block is cached hits one block short."""
    mgr = KVCacheManager([FULL], num_blocks=10, block_size=4)
    admit(mgr, make_request("a", list(range(8))))
    hit = mgr.lookup(make_request("b", list(range(8))))
    assert hit.num_tokens == 4


def test_sliding_window_hits_after_its_early_blocks_were_evicted(make_request) -> None:
    """Only the blocks the window reads at the hit length must still be cached."""
    mgr = KVCacheManager([SlidingWindow(window=5)], num_blocks=6, block_size=4)
    a = make_request("a", list(range(17)))
    admit(mgr, a, num_tokens=8)
    mgr.allocate(a, 8)  # window slid: block 0 (page 1) released, still cached
    mgr.free("a")  # queue (front first): 2 free ... cached pages tail first
    mgr.allocate(make_request("x", [9, 9, 9, 9]), 4)  # takes a page, evicting one
    hit = mgr.lookup(make_request("b", [*range(16), 5]))
    assert hit.num_tokens == 16
    assert hit.block_tables == ((0, 0, 0, 4),)
    mgr.check_integrity()


def test_the_common_hit_is_the_fixed_point_over_groups(make_request) -> None:
    """Full attention hits 3 blocks, the window only at 2: both resume at 2 blocks."""
    mgr = KVCacheManager([FULL, SlidingWindow(window=3)], num_blocks=30, block_size=4)
    a = make_request("a", list(range(14)))
    admit(mgr, a)
    # Evict the window group's block 2 only: uncache its page.
    mgr.pool.uncache(mgr.block_tables("a")[1][2])
    mgr.free("a")
    hit = mgr.lookup(make_request("b", list(range(14))))
    assert hit.num_tokens == 8
    assert hit.block_tables == ((1, 2), (0, 6))


def test_a_failed_allocation_changes_nothing(make_request) -> None:
    """When one group cannot get its page, no group gets one and the pool is untouched."""
    mgr = KVCacheManager([FULL, SlidingWindow(window=8)], num_blocks=6, block_size=4)
    req = make_request("r", list(range(8)))
    admit(mgr, req)
    assert mgr.num_free_blocks == 1

    def snapshot() -> object:
        pool = mgr.pool
        return (
            [t[:] for t in mgr.block_tables("r")],
            [pool.ref_count(p) for p in range(6)],
            [p for p in range(6) if pool.is_free(p)],
            [dict(pool.cached_blocks(g)) for g in range(2)],
        )

    before = snapshot()
    req.all_token_ids.append(9)
    assert mgr.allocate(req, 1) is None
    assert snapshot() == before
    mgr.check_integrity()


def test_a_released_page_counts_toward_the_allocation_that_releases_it(make_request) -> None:
    """A window block that dies in this step frees the page the step needs."""
    mgr = KVCacheManager([SlidingWindow(window=1)], num_blocks=2, block_size=2)
    req = make_request("r", [1, 2])
    admit(mgr, req)
    assert decode(mgr, req, 3) == ([1],)  # block 0 is dead at position 2: its page is reused
    assert mgr.block_tables("r") == [[0, 1]]


def test_freeing_an_uncomputed_step_uncaches_its_blocks(make_request) -> None:
    """Blocks cached by an allocation whose step never ran cannot be hit afterwards."""
    mgr = KVCacheManager([FULL], num_blocks=10, block_size=4)
    req = make_request("r", list(range(9)))
    admit(mgr, req)
    mgr.free("r", computed=False)
    assert mgr.lookup(make_request("b", list(range(9)))).num_tokens == 0
    mgr.check_integrity()


def test_a_stale_hit_is_refused(make_request) -> None:
    """Using a hit after its pages were reused raises instead of reading wrong pages."""
    mgr = KVCacheManager([FULL], num_blocks=3, block_size=2)
    admit(mgr, make_request("a", [1, 2, 3]))
    mgr.free("a")
    b = make_request("b", [1, 2, 5])
    hit = mgr.lookup(b)
    assert hit.num_tokens == 2
    mgr.allocate(make_request("x", [8, 8, 8, 8]), 4)
    mgr.free("x")
    with pytest.raises(StaleHitError, match="reused"):
        mgr.allocate(b, 1, hit)


def test_requests_are_released_tail_first(make_request) -> None:
    """A freed request's last block is evicted before its first."""
    mgr = KVCacheManager([FULL], num_blocks=4, block_size=2)
    admit(mgr, make_request("a", [1, 2, 3, 4, 5, 6]))
    mgr.free("a")
    assert mgr.allocate(make_request("x", [0]), 1) == ([3],)


def test_salted_requests_do_not_share_blocks(make_request) -> None:
    """Different cache salts give different hashes for the same tokens."""
    mgr = KVCacheManager([FULL], num_blocks=10, block_size=4)
    admit(mgr, make_request("a", list(range(9)), ("tenant-1",)))
    assert mgr.lookup(make_request("b", list(range(9)), ("tenant-2",))).num_tokens == 0
    assert mgr.lookup(make_request("c", list(range(9)), ("tenant-1",))).num_tokens == 8


def test_prefix_caching_off_never_hits(make_request) -> None:
    """With caching disabled, lookup returns no hit and nothing is counted."""
    mgr = KVCacheManager([FULL], 10, 4, enable_prefix_caching=False)
    admit(mgr, make_request("a", list(range(9))))
    assert mgr.lookup(make_request("b", list(range(9)))).num_tokens == 0
    assert mgr.usage().prefix_query_tokens == 0


def test_blocks_needed_counts_every_group_at_its_peak() -> None:
    """The admission bound is the live blocks of each group at the last position."""
    mgr = KVCacheManager([FULL, SlidingWindow(window=5), MambaLike()], 100, 4)
    # full: cdiv(40, 4) = 10; window: cdiv(4, 4) + 1 = 2; mamba: 3 (read, checkpoint, new)
    assert mgr.num_blocks_needed(40) == 15


def test_chunked_local_drops_the_previous_chunk_at_a_chunk_start(make_request) -> None:
    """With C=8, bs=4, computing position 16 starts a chunk: blocks 0..3 are released."""
    mgr = KVCacheManager([ChunkedLocal(chunk=8)], num_blocks=10, block_size=4)
    req = make_request("r", list(range(15)))
    assert mgr.allocate(req, 15) == ([1, 2, 3, 4],)
    decode(mgr, req, 40)  # position 15: chunk [8, 16) -> blocks 0, 1 dead
    assert mgr.block_tables("r") == [[0, 0, 3, 4]]
    decode(mgr, req, 41)  # position 16: a new chunk reads nothing before it
    assert mgr.block_tables("r") == [[0, 0, 0, 0, 5]]
    mgr.check_integrity()


def test_a_chunk_start_needs_no_cached_block(make_request) -> None:
    """Chunks of a chunked-local-only model are independent: resuming at a chunk start
    needs nothing cached, so lookup reports that prefix as a hit (a full-attention group
    beside it bounds the hit to what is really cached)."""
    alone = KVCacheManager([ChunkedLocal(chunk=8)], num_blocks=10, block_size=4)
    assert alone.lookup(make_request("a", list(range(15)))).num_tokens == 8
    mixed = KVCacheManager([FULL, ChunkedLocal(chunk=8)], num_blocks=10, block_size=4)
    assert mixed.lookup(make_request("a", list(range(15)))).num_tokens == 0


def test_mamba_hit_needs_only_the_state_at_the_boundary(make_request) -> None:
    """A mamba group resumes from the cached page of the last hit block alone."""
    mgr = KVCacheManager([MambaLike()], num_blocks=10, block_size=4)
    a = make_request("a", list(range(13)))
    admit(mgr, a)
    mgr.free("a")
    hit = mgr.lookup(make_request("b", [*range(12), 99]))
    assert hit.num_tokens == 12
    assert hit.block_tables == ((0, 0, 1),)


def test_spare_chunk_fits_the_pages_nobody_keeps_and_never_goes_below_its_floor(
    make_request,
) -> None:
    """A window pool's chunk is halved until its pages come from pages no kept prefix
    holds, not below ``at_least``; a chunk at or under the floor is left alone."""
    window = SlidingWindow(window=8)
    mgr = KVCacheManager([FULL, window], num_blocks=25, block_size=4)
    first = make_request("first", list(range(100, 124)))
    admit(mgr, first)
    mgr.free("first")  # its prefix is kept: 6 full-attention pages and the window's
    assert mgr.pool.reusable()[0] < 24 - 6
    long = make_request("long", list(range(40)))
    hit = mgr.lookup(long)
    assert mgr.spare_chunk(long, 40, hit, at_least=8) == 20  # 10 pages: fits
    assert mgr.spare_chunk(long, 40, hit, at_least=32) == 32  # the floor
    assert mgr.spare_chunk(long, 6, hit, at_least=8) == 6
    alone = KVCacheManager([FULL], num_blocks=25, block_size=4)
    assert alone.spare_chunk(make_request("x", list(range(40))), 40, at_least=8) == 40


# -- checkpoints placed by the policy ----------------------------------------------------


@pytest.mark.parametrize("span", [1, 4])
def test_a_prompt_leaving_a_shared_prefix_keeps_a_state_where_it_leaves(make_request, span) -> None:
    """A second prompt sharing 10 blocks of a first one (prefilled at once, so with no
    state there) recomputes them, keeping a state at the shared end: a third resumes at
    the 10 blocks (at 4-token blocks; a state page spans ``span`` pages)."""
    mgr = KVCacheManager([FULL, MambaLike()], 400, 4, state_span=span)
    shared = list(range(40))
    first = make_request("a", [*shared, *([1] * 30)])
    admit(mgr, first)
    second = make_request("b", [*shared, *([2] * 9)])
    hit, _ = admit(mgr, second)
    assert hit.num_tokens == 0 and hit.checkpoints == (40,)
    assert mgr.block_tables("b")[1][9]  # the state after the shared 40 tokens has a page
    mgr.free("a")
    mgr.free("b")
    hit, _ = admit(mgr, make_request("c", [*shared, *([3] * 5)]))
    assert hit.num_tokens == 40 and hit.checkpoints == ()
    mgr.check_integrity()


def test_a_long_prefill_keeps_states_at_doubling_block_counts(make_request) -> None:
    """By default a state policy keeps a state after 16, 32, 64, ... blocks of a prefill
    (besides the last boundary and the running state); a user's state policy, written
    with ``live_spans`` alone, gets the same (the rule is derived)."""
    import attrs

    from hybridkv.policies import MemoryPolicy, Span

    @attrs.frozen
    class LastTokenState(MemoryPolicy):
        keeps_state = True

        def live_spans(self, num_tokens: int) -> tuple[Span, ...]:
            return ((num_tokens - 1, num_tokens),) if num_tokens else ()

    for policy in (MambaLike(), LastTokenState()):
        assert policy.page_blocks(0, 4 * 100, 4) == [15, 31, 63, 98, 99]
        assert policy.page_blocks(4 * 20, 4 * 100, 4) == [31, 63, 98, 99]
    assert MambaLike(checkpoint_every=40).page_blocks(0, 400, 4) == [39, 79, 98, 99]
