"""The free queue: cold pages first, then kept prefixes (see test_eviction_order.py)."""

from __future__ import annotations

from hybridkv.memory import BlockHash
from hybridkv.memory.free_queue import FreeQueue, KeptPrefix


def hashes_for(num_blocks: int, cached: range) -> list[BlockHash | None]:
    """A page -> hash list where the pages in ``cached`` carry a hash."""
    return [BlockHash(b"p%d" % p) if p in cached else None for p in range(num_blocks)]


def path(name: str, num_blocks: int) -> list[BlockHash]:
    return [BlockHash(f"{name}{i}".encode()) for i in range(num_blocks)]


def freed(queue: FreeQueue, pages: list[int], hashes: list[BlockHash | None]) -> None:
    """Take ``pages`` out of the queue (as an allocation would) and free them again."""
    queue.remove_all(pages)
    queue.push(pages, hashes)


def test_unhashed_then_unneeded_pages_are_taken_before_kept_ones() -> None:
    """Cold pages (unhashed first) go before any page a kept prefix needs."""
    hashes = hashes_for(8, range(1, 6))
    queue = FreeQueue(8)
    freed(queue, [1, 2, 3, 4, 5, 6, 7], hashes)
    queue.keep(KeptPrefix(path("a", 2), [1, 2], num_blocks=2, num_groups=0, is_branch=False))
    assert queue.take(5) == [7, 6, 3, 4, 5]  # unhashed last-freed first, then hashed in order
    assert queue.take(2) == [1, 2]
    queue.check_integrity([None] * 8)


def test_a_nested_prefix_gives_up_a_run_of_blocks_from_its_end() -> None:
    """A full-attention prefix gives up its last blocks first (at least a run of 8), and
    the shorter prefix stays kept."""
    hashes = hashes_for(14, range(1, 14))
    queue = FreeQueue(14)
    freed(queue, list(range(1, 14)), hashes)
    # Blocks 0..11 on pages 1..12, listed last block first; page 13 is cold.
    prefix = queue.keep(KeptPrefix(path("a", 12), list(range(12, 0, -1)), 12, 1, False))
    assert queue.take(2) == [13, 12]
    assert prefix.num_blocks == 4 and queue.find(prefix.key) is prefix
    assert queue.is_kept(4) and not queue.is_kept(5)
    assert queue.take(7) == [11, 10, 9, 8, 7, 6, 5]  # given up, still in order
    assert prefix.num_blocks == 4
    queue.check_integrity(hashes)


def test_a_unit_prefix_gives_up_all_its_pages_at_once() -> None:
    """Losing one page of a window's prefix turns all of its pages cold, every group."""
    hashes = hashes_for(7, range(1, 7))
    queue = FreeQueue(7)
    freed(queue, [1, 2, 3, 4, 5, 6], hashes)
    old = queue.keep(KeptPrefix(path("a", 5), [1, 2, 3], 5, 0, False))
    new = queue.keep(KeptPrefix(path("b", 5), [4, 5, 6], 5, 0, False))
    assert queue.take(1) == [4]  # neither was resumed: the newer goes first
    assert not any(queue.is_kept(p) for p in (5, 6)) and queue.find(new.key) is None
    assert queue.take(2) == [5, 6]  # the rest of the lost prefix, before the other one
    assert all(queue.is_kept(p) for p in (1, 2, 3)) and queue.find(old.key) is old


def test_a_page_shared_with_another_kept_prefix_stays_kept() -> None:
    """Giving up a prefix keeps the pages another kept prefix also needs."""
    hashes = hashes_for(13, range(1, 13))
    queue = FreeQueue(13)
    freed(queue, list(range(1, 13)), hashes)
    shared = queue.keep(KeptPrefix(path("a", 2), [2, 1], 2, 1, True))  # a's first 2 blocks
    queue.keep(KeptPrefix(path("a", 12), list(range(12, 0, -1)), 12, 1, False))  # newer
    assert queue.take(9) == list(range(12, 3, -1))  # a's blocks 11..3
    assert queue.is_kept(1) and queue.is_kept(2) and shared.num_blocks == 2
    assert queue.take(2) == [3, 2]  # a is gone: the shared prefix gives up now
    assert queue.find(shared.key) is None
    queue.check_integrity(hashes)


def test_keeping_an_equal_prefix_refreshes_the_kept_one() -> None:
    """A prefix with a kept one's key adds no holder; it makes that one recent (a branch)."""
    queue = FreeQueue(4)
    first = queue.keep(KeptPrefix(path("a", 1), [1], 1, 1, False))
    queue.keep(KeptPrefix(path("b", 1), [2], 1, 1, False))
    assert queue.keep(KeptPrefix(path("a", 1), [1], 1, 1, True)) is first
    assert first.is_branch and list(queue.kept_prefixes())[-1] is first
    queue.check_integrity(hashes_for(4, range(1, 3)))


def test_letting_go_of_a_prefix_turns_its_free_pages_cold() -> None:
    """A prefix a request continues from no longer holds its pages."""
    hashes = hashes_for(4, range(1, 4))
    queue = FreeQueue(4)
    freed(queue, [1, 2, 3], hashes)
    prefix = queue.keep(KeptPrefix(path("a", 3), [1, 2, 3], 3, 0, False))
    queue.let_go(prefix)
    assert not any(queue.is_kept(p) for p in (1, 2, 3)) and queue.find(prefix.key) is None
    queue.check_integrity(hashes)


def test_forgetting_a_page_shrinks_a_nested_prefix_below_its_block() -> None:
    """A page that lost its contents leaves the blocks before it kept."""
    hashes = hashes_for(5, range(1, 5))
    queue = FreeQueue(5)
    freed(queue, [1, 2, 3, 4], hashes)
    prefix = queue.keep(KeptPrefix(path("a", 4), [4, 3, 2, 1], 4, 1, False))
    queue.forget(3)  # block 2
    assert prefix.num_blocks == 2 and not queue.is_kept(3) and not queue.is_kept(4)
    assert queue.is_kept(2) and queue.is_kept(1)
