"""The block pool: N equal pages shared by every KV group, page 0 the null block.

Free pages wait in a :class:`~hybridkv.memory.free_queue.FreeQueue`, in eviction order::

    taken first                                               taken when nothing else is
    [ unhashed | hashed, needed by no kept prefix ]  [ needed by a kept prefix: the one
                                                       resumed farthest off gives up first ]

A page that carries a block hash stays findable through the cache map after it is freed,
until a fresh allocation takes it from the queue and evicts the hash; a prefix hit can
take a cached free page back from anywhere in the queue, in O(1). Which prefixes are kept
is decided in ``hybridkv.memory.retention``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NewType

from hybridkv.memory.errors import LayoutError
from hybridkv.memory.free_queue import FreeQueue, KeptPrefix
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
        # The cache key of a page, split in two lists: its hash (or None) and its group,
        # which is also the group its holders use it for.
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._group = [0] * num_blocks
        self._cached: list[dict[BlockHash, int]] = [{} for _ in range(num_groups)]
        self._free = FreeQueue(num_blocks)
        self.num_used_per_group = [0] * num_groups
        #: Pages that lost their hash through :meth:`uncache` so far (a change counter).
        self.num_uncached = 0

    @property
    def num_free(self) -> int:
        """Pages that an allocation may take (cached free pages included)."""
        return len(self._free)

    @property
    def num_reusable(self) -> int:
        """Free pages that no kept prefix holds (taken before any kept prefix's)."""
        return self._free.num_reusable

    def ref_count(self, page: int) -> int:
        """References held on ``page`` by request tables."""
        return self._ref[page]

    def is_free(self, page: int) -> bool:
        """Whether ``page`` sits in the free queue."""
        return page in self._free

    def is_kept(self, page: int) -> bool:
        """Whether a kept prefix needs ``page`` (free or not)."""
        return self._free.is_kept(page)

    def lookup(self, block_hash: BlockHash, group: int) -> int | None:
        """The page caching ``block_hash`` for ``group``, free or in use, or None."""
        return self._cached[group].get(block_hash)

    def cached_blocks(self, group: int) -> Mapping[BlockHash, int]:
        """The prefix-cache map of ``group``: block hash -> page (read-only)."""
        return self._cached[group]

    def take(self, page: int, group: int) -> None:
        """Add a reference to a cached page (a prefix hit), pulling it off the free queue."""
        if self._ref[page] == 0:
            self._free.remove_all((page,))
            self.num_used_per_group[group] += 1
        self._ref[page] += 1

    def take_tables(self, tables: Sequence[Sequence[int]]) -> None:
        """:meth:`take` every page of a hit's per-group tables (the null block skipped)."""
        ref, used = self._ref, self.num_used_per_group
        freed = []
        for group, table in enumerate(tables):
            for page in table:
                if not page:
                    continue
                if not ref[page]:
                    freed.append(page)
                    used[group] += 1
                ref[page] += 1
        self._free.remove_all(freed)

    def num_free_in(self, tables: Sequence[Sequence[int]]) -> int:
        """How many pages of these per-group tables are free (the null block skipped)."""
        ref = self._ref
        return sum(1 for table in tables for page in table if page and not ref[page])

    def num_reusable_in(self, tables: Sequence[Sequence[int]]) -> int:
        """How many pages of these per-group tables are free and held by no kept prefix."""
        ref, is_kept = self._ref, self._free.is_kept
        return sum(
            1 for table in tables for page in table if page and not ref[page] and not is_kept(page)
        )

    def allocate(self, num: int, group: int) -> list[int]:
        """Take ``num`` pages for ``group`` from the free queue, evicting their hashes.

        The caller has checked ``num <= num_free``.
        """
        return self.allocate_groups(num, (group,))[0]

    def allocate_groups(self, num: int, groups: Sequence[int]) -> tuple[list[int], ...]:
        """Take ``num`` pages for each of ``groups`` at once (see :meth:`allocate`)."""
        pages = self._free.take(num * len(groups))
        if len(groups) == 1:
            out: tuple[list[int], ...] = (pages,)
            owners: Sequence[int] = [groups[0]] * num
        elif num == 1:  # most multi-group calls: a decode step crossing into a new block
            out = tuple(map(list, zip(pages)))
            owners = groups
        else:
            out = tuple(pages[k * num : (k + 1) * num] for k in range(len(groups)))
            owners = [group for group in groups for _ in range(num)]
        ref, hashes, owner, cached = self._ref, self._hash, self._group, self._cached
        for page, group in zip(pages, owners, strict=True):
            old = hashes[page]
            if old is not None:
                del cached[owner[page]][old]
                hashes[page] = None
            ref[page] = 1
            owner[page] = group
        used = self.num_used_per_group
        for group in groups:
            used[group] += num
        return out

    def release(self, pages: Iterable[int], group: int | None = None) -> None:
        """Drop one reference on each page; pages at zero become free.

        ``group``: the group of every page, or None for pages of several groups. Unhashed
        pages are reused first (nothing to lose), then hashed pages no kept prefix needs,
        in the order released (pass a request's later blocks first), then pages of kept
        prefixes.
        """
        ref = self._ref
        freed: list[int] = []
        append = freed.append
        for page in pages:
            count = ref[page] - 1
            ref[page] = count
            if not count:
                append(page)
        if group is not None:
            self.num_used_per_group[group] -= len(freed)
        else:
            used, owner = self.num_used_per_group, self._group
            for page in freed:
                used[owner[page]] -= 1
        self._free.push(freed, self._hash)

    def keep(self, prefix: KeptPrefix, *, in_use: bool = False, pinned: bool = False) -> KeptPrefix:
        """Keep a resumable prefix's pages for future hits (see ``FreeQueue.keep``)."""
        return self._free.keep(prefix, in_use=in_use, pinned=pinned)

    def stop_keeping(self, prefix: KeptPrefix, *, in_use: bool) -> None:
        """A request continues from ``prefix``: its pages need no longer be kept for it
        (``in_use``: the request holds them all)."""
        self._free.let_go(prefix, in_use=in_use)

    def extend_kept(
        self,
        prefix: KeptPrefix,
        hashes: Sequence[BlockHash],
        pages: list[int],
        num_blocks: int,
    ) -> bool:
        """Grow a kept nested prefix by its continuation's blocks (see ``FreeQueue.extend``)."""
        return self._free.extend(prefix, hashes, pages, num_blocks)

    def resume(self, prefix: KeptPrefix) -> None:
        """A request resumed from a kept ``prefix``: pinned until :meth:`release_kept`."""
        self._free.resume(prefix)

    def release_kept(self, prefix: KeptPrefix) -> None:
        """The request that pinned ``prefix`` ended (see ``FreeQueue.release``)."""
        self._free.release(prefix)

    def recall_evicted(self, hashes: Sequence[BlockHash]) -> int:
        """The reuse distance of the longest prefix of ``hashes`` eviction gave up, or 0."""
        return self._free.recall(hashes)

    def kept_prefix(self, key: BlockHash) -> KeptPrefix | None:
        """The kept prefix whose last block hashes to ``key``, if any."""
        return self._free.find(key)

    def kept_prefixes(self) -> Iterable[KeptPrefix]:
        """Every prefix kept now."""
        return self._free.kept_prefixes()

    def cache(self, page: int, block_hash: BlockHash, group: int) -> bool:
        """Make ``page`` findable as ``block_hash`` of ``group``; False if it stays uncached.

        A block whose hash is already cached (the same tokens computed twice, by requests
        that did not share a prefix) keeps the first page; this one stays uncached.
        """
        table = self._cached[group]
        if block_hash in table or self._hash[page] is not None:
            return self._hash[page] == block_hash and table.get(block_hash) == page
        table[block_hash] = page
        self._hash[page] = block_hash
        self._group[page] = group
        return True

    def cache_blocks(
        self,
        tables: Sequence[Sequence[int]],
        hashes: Sequence[BlockHash],
        start: int,
        stop: int,
    ) -> int:
        """Cache blocks ``start .. stop-1`` of every group's table (as :meth:`cache`).

        Returns how many of those pages stayed uncached (their block was cached before).
        """
        page_hash, owner, maps = self._hash, self._group, self._cached
        num_uncached = 0
        for i in range(start, stop):
            block_hash = hashes[i]
            for group, table in enumerate(tables):
                page = table[i]
                if not page:
                    continue
                cached = maps[group]
                if block_hash in cached or page_hash[page] is not None:
                    num_uncached += cached.get(block_hash) != page
                    continue
                cached[block_hash] = page
                page_hash[page] = block_hash
                owner[page] = group
        return num_uncached

    def uncache(self, page: int) -> None:
        """Forget the hash of ``page`` (its contents were never written).

        The kept prefixes that needed it shrink below it or go.
        """
        block_hash = self._hash[page]
        if block_hash is None:
            return
        self._free.forget(page)
        del self._cached[self._group[page]][block_hash]
        self._hash[page] = None
        self.num_uncached += 1
        if page in self._free:
            self._free.remove_all((page,))
            self._free.push((page,), self._hash)

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
        self._free.check_integrity(self._hash)
