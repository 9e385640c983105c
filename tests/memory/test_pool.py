"""The block pool: eviction order, reference counts, the cache map."""

from __future__ import annotations

import pytest

from hybridkv.memory import BlockHash, BlockPool, LayoutError
from hybridkv.memory.span_pool import SpanPool


def h(name: str) -> BlockHash:
    return BlockHash(name.encode())


def test_fresh_pool_hands_out_pages_in_order_and_never_the_null_page() -> None:
    """Page 0 is never allocated; the rest come in id order."""
    pool = BlockPool(5, num_groups=1)
    assert pool.allocate(4, group=0) == [1, 2, 3, 4]
    assert pool.num_free == 0
    pool.check_integrity()


def test_unhashed_pages_are_reused_before_cached_ones() -> None:
    """A freed page with no hash is taken before a freed cached page."""
    pool = BlockPool(4, num_groups=1)
    a, b, _ = pool.allocate(3, group=0)
    pool.cache(a, h("a"), 0)
    pool.release([a])
    pool.release([b])
    assert pool.allocate(1, 0) == [b]
    assert pool.allocate(1, 0) == [a]  # the cached page goes last, evicting its hash
    assert pool.lookup(h("a"), 0) is None
    pool.check_integrity()


def test_cached_pages_are_evicted_least_recently_freed_first() -> None:
    """Cached free pages leave the queue in the order they were freed."""
    pool = BlockPool(4, num_groups=1)
    pages = pool.allocate(3, 0)
    for page, name in zip(pages, "xyz", strict=True):
        pool.cache(page, h(name), 0)
    pool.release([3, 1, 2])  # tail first as a request would, then another order
    assert pool.allocate(3, 0) == [3, 1, 2]


def test_take_pulls_a_cached_free_page_out_of_the_middle_of_the_queue() -> None:
    """A prefix hit on a free cached page removes it from the free queue."""
    pool = BlockPool(5, num_groups=2)
    pages = pool.allocate(3, 1)
    for page, name in zip(pages, "abc", strict=True):
        pool.cache(page, h(name), 1)
    pool.release(reversed(pages))
    page = pool.lookup(h("b"), 1)
    assert page == 2
    pool.take(2, 1)
    assert pool.ref_count(2) == 1 and not pool.is_free(2)
    assert pool.allocate(3, 0) == [4, 3, 1]
    assert pool.num_used_per_group == [3, 1]
    pool.check_integrity()


def test_reference_counts_keep_shared_pages_in_use() -> None:
    """A page freed by one of two holders stays in use."""
    pool = BlockPool(3, num_groups=1)
    (page,) = pool.allocate(1, 0)
    pool.cache(page, h("p"), 0)
    pool.take(page, 0)
    pool.release([page])
    assert pool.ref_count(page) == 1 and not pool.is_free(page)
    pool.release([page])
    assert pool.is_free(page) and pool.lookup(h("p"), 0) == page
    pool.check_integrity()


def test_the_same_hash_is_cached_once_per_group() -> None:
    """Caching a duplicate block keeps the first page; groups have separate maps."""
    pool = BlockPool(4, num_groups=2)
    a, b = pool.allocate(2, 0)
    (c,) = pool.allocate(1, 1)
    pool.cache(a, h("k"), 0)
    pool.cache(b, h("k"), 0)
    pool.cache(c, h("k"), 1)
    assert pool.lookup(h("k"), 0) == a and pool.lookup(h("k"), 1) == c
    pool.check_integrity()


def test_uncache_forgets_the_hash_and_makes_the_page_first_to_reuse() -> None:
    """An uncached free page moves to the front of the queue."""
    pool = BlockPool(4, num_groups=1)
    pages = pool.allocate(3, 0)
    for page, name in zip(pages, "abc", strict=True):
        pool.cache(page, h(name), 0)
    pool.release(pages)
    pool.uncache(3)
    assert pool.lookup(h("c"), 0) is None
    assert pool.allocate(1, 0) == [3]
    pool.check_integrity()


def test_a_pool_needs_a_page_besides_the_null_page() -> None:
    """A one-page pool is rejected with the count in the message."""
    with pytest.raises(LayoutError, match="got 1"):
        BlockPool(1, num_groups=1)


# -- two page sizes: state pages are spans of small pages --------------------------------


def span_pool() -> SpanPool:
    """16 page ids in spans of 4; group 0 K/V (one id a page), group 1 states (four)."""
    return SpanPool(16, 2, (1, 4))


def test_a_state_page_is_an_aligned_span_and_small_pages_fill_spans_in_use_first() -> None:
    pool = span_pool()
    assert pool.num_free == 15 and pool.num_free_spans == 3  # span 0 holds the null page
    (state,) = pool.allocate(1, group=1)
    assert state % 4 == 0 and state != 0
    small = pool.allocate(3, group=0)
    assert {p // 4 for p in small} == {0}  # the null page's span, before an empty one
    assert pool.num_free_spans == 2 and pool.num_free == 15 - 4 - 3
    pool.check_integrity()


def test_a_state_page_evicts_cached_pages_in_order_until_a_span_is_free() -> None:
    pool = span_pool()
    pages = pool.allocate(15, group=0)  # every id a K/V page
    for page in pages:
        pool.cache(page, h(f"p{page}"), 0)
    pool.release(pages[3:])  # spans 1-3 free, cached; span 0 still in use
    assert pool.num_free_spans == 3
    (state,) = pool.allocate(1, group=1)
    assert state == 4  # the span of the least recently freed pages
    assert [pool.lookup(h(f"p{p}"), 0) for p in (4, 5, 6, 7, 8)] == [None] * 4 + [8]
    pool.check_integrity()


def test_free_ids_scattered_over_spans_in_use_hold_no_state_page() -> None:
    pool = span_pool()
    pages = pool.allocate(15, group=0)
    pool.release([p for p in pages if p % 4 != 1])  # one page in use in every span
    assert pool.num_free == 11 and pool.num_free_spans == 0
    assert pool.fits(11, 0) and not pool.fits(0, 1)
    pool.release([5])
    assert pool.fits(8, 1) and not pool.fits(9, 1)  # the span takes 4 of the 12 free ids
    pool.check_integrity()


def test_a_cached_state_page_is_found_and_taken_back_whole() -> None:
    pool = span_pool()
    (state,) = pool.allocate(1, group=1)
    pool.cache(state, h("s"), 1)
    pool.release([state], group=1)
    assert pool.num_free == 15 and pool.lookup(h("s"), 1) == state
    pool.take(state, 1)
    assert pool.num_free == 11 and pool.ref_count(state) == 1
    pool.check_integrity()


def test_widths_are_checked() -> None:
    with pytest.raises(LayoutError, match="multiple of 4"):
        SpanPool(18, 2, (1, 4))
    with pytest.raises(LayoutError, match="one state span"):
        SpanPool(16, 2, (2, 4))
