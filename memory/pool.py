"""The block pool: N equal pages shared by every KV group, page 0 the null block.

Free pages wait in one queue in eviction order (an ``OrderedDict``: a C-level doubly
linked list with O(1) removal from the middle, which a prefix hit needs to take a cached
free page back)::

    front (taken first)                                          back (taken last)
    [ unhashed pages, last freed first | hashed pages, least recently freed first ]

A page that carries a block hash stays findable through the cache map after it is freed,
until a fresh allocation takes it from the front of the queue and evicts the hash.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import NewType

from hybridkv.memory.errors import LayoutError
from hybridkv.memory.hashing import BlockHash

BlockId = NewType("BlockId", int)

#: Stands in the table for a block that is not held (released by its policy, never needed).
NULL_BLOCK = BlockId(0)


class BlockPool:
    """Pages, their reference counts, the free queue and the prefix-cache map.

    Every method is O(pages touched). The pool never decides what to free: the KV cache
    manager does, and the pool keeps the bookkeeping exact (see :meth:`check_integrity`).
    """

    def __init__(self, num_blocks: int, num_groups: int) -> None:
        if num_blocks < 2:
            raise LayoutError(f"a block pool needs >= 2 pages (page 0 is null), got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        # The cache key of a page, split in two lists: its hash and its group (or None).
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._group = [0] * num_blocks
        self._cached: list[dict[BlockHash, int]] = [{} for _ in range(num_groups)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.num_used_per_group = [0] * num_groups

    @property
    def num_free(self) -> int:
        """Pages that an allocation may take (cached free pages included)."""
        return len(self._free)

    def ref_count(self, page: int) -> int:
        """References held on ``page`` by request tables."""
        return self._ref[page]

    def is_free(self, page: int) -> bool:
        """Whether ``page`` sits in the free queue."""
        return page in self._free

    def lookup(self, block_hash: BlockHash, group: int) -> int | None:
        """The page caching ``block_hash`` for ``group``, free or in use, or None."""
        return self._cached[group].get(block_hash)

    def cached_blocks(self, group: int) -> Mapping[BlockHash, int]:
        """The prefix-cache map of ``group``: block hash -> page (read-only)."""
        return self._cached[group]

    def take(self, page: int, group: int) -> None:
        """Add a reference to a cached page (a prefix hit), pulling it off the free queue."""
        if self._ref[page] == 0:
            del self._free[page]
            self.num_used_per_group[group] += 1
        self._ref[page] += 1

    def allocate(self, num: int, group: int) -> list[int]:
        """Take ``num`` pages from the front of the free queue, evicting their hashes.

        The caller has checked ``num <= num_free``.
        """
        pages = []
        popitem, ref, hashes, groups = self._free.popitem, self._ref, self._hash, self._group
        for _ in range(num):
            page = popitem(last=False)[0]
            old = hashes[page]
            if old is not None:
                del self._cached[groups[page]][old]
                hashes[page] = None
            ref[page] = 1
            groups[page] = group
            pages.append(page)
        self.num_used_per_group[group] += num
        return pages

    def release(self, pages: Iterable[int], group: int) -> None:
        """Drop one reference on each page, in the order given; pages at zero become free.

        Unhashed pages go to the front (reused first, nothing to lose), hashed pages to the
        back (evicted last). Callers pass a request's pages tail first, so a prefix's later
        blocks are evicted before its earlier ones.
        """
        ref, hashes, free = self._ref, self._hash, self._free
        freed = 0
        for page in pages:
            count = ref[page] - 1
            ref[page] = count
            if count:
                continue
            freed += 1
            free[page] = None
            if hashes[page] is None:
                free.move_to_end(page, last=False)
        self.num_used_per_group[group] -= freed

    def cache(self, page: int, block_hash: BlockHash, group: int) -> None:
        """Make ``page`` findable as ``block_hash`` of ``group``.

        A block whose hash is already cached (the same tokens computed twice, by requests
        that did not share a prefix) keeps the first page; this one stays uncached.
        """
        table = self._cached[group]
        if block_hash in table or self._hash[page] is not None:
            return
        table[block_hash] = page
        self._hash[page] = block_hash
        self._group[page] = group

    def uncache(self, page: int) -> None:
        """Forget the hash of ``page`` (its contents were never written)."""
        block_hash = self._hash[page]
        if block_hash is None:
            return
        del self._cached[self._group[page]][block_hash]
        self._hash[page] = None
        if page in self._free:
            self._free.move_to_end(page, last=False)

    def check_integrity(self) -> None:
        """Assert the pool's own invariants (tests call it after every operation)."""
        assert self._ref[0] == 0 and 0 not in self._free and self._hash[0] is None
        for page in range(1, self.num_blocks):
            assert (self._ref[page] == 0) == (page in self._free), page
            assert self._ref[page] >= 0, page
        for group, table in enumerate(self._cached):
            for block_hash, page in table.items():
                assert self._hash[page] == block_hash and self._group[page] == group
        num_cached = sum(1 for h in self._hash if h is not None)
        assert num_cached == sum(len(t) for t in self._cached)
        assert sum(self.num_used_per_group) == self.num_blocks - 1 - self.num_free
