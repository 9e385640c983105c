"""The block pool: N small pages shared by every KV group, page 0 the null block.

Every group takes one page per block. Where a state needs more bytes than a page, the
pool of ``hybridkv.memory.span_pool`` gives state groups spans of pages instead.

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

from hybridkv.memory.cache_events import DEVICE, CacheEventLog
from hybridkv.memory.errors import LayoutError
from hybridkv.memory.eviction_order import EvictionOrder
from hybridkv.memory.free_queue import FreeQueue, KeptPrefix
from hybridkv.memory.hashing import BlockHash

BlockId = NewType("BlockId", int)

#: Stands in the table for a block that is not held (released by its policy, never needed).
NULL_BLOCK = BlockId(0)


class BlockPool:
    """Pages, their reference counts, the free queue and the prefix-cache map.

    Every method is O(pages touched). The pool never decides what to free: the KV cache
    manager does, and the pool keeps the bookkeeping exact (see :meth:`check_integrity`).

    Args:
        num_blocks: Pages, the null page 0 included.
        num_groups: KV groups.
    """

    #: Page ids one page of each group takes (all 1 here; see ``SpanPool``).
    widths: tuple[int, ...]
    #: Page ids of one state page.
    span = 1
    #: Never-cached free pages are kept apart from the free queue (``SpanPool``: holes).
    _HOLES = False

    def __init__(self, num_blocks: int, num_groups: int) -> None:
        if num_blocks < 2:
            raise LayoutError(f"a block pool needs >= 2 pages (page 0 is null), got {num_blocks}")
        self.widths = (1,) * num_groups
        self._num_free = num_blocks - 1
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        # The cache key of a page, split in two lists: its hash (or None) and its group,
        # which is also the group its holders use it for.
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._group = [0] * num_blocks
        self._cached: list[dict[BlockHash, int]] = [{} for _ in range(num_groups)]
        self._free = FreeQueue(num_blocks, start_empty=self._HOLES)
        self.num_used_per_group = [0] * num_groups
        #: Pages that lost their hash through :meth:`uncache` so far (a change counter).
        self.num_uncached = 0
        #: Where hashes entering and leaving the cache map are reported, if anywhere.
        self.events: CacheEventLog | None = None

    @property
    def num_free(self) -> int:
        """Page ids that an allocation may take (cached free pages included)."""
        return self._num_free

    @property
    def num_free_spans(self) -> int:
        """State pages that could be taken now, evicting cached pages where needed (every
        span free of pages in use); 0 in a pool without state spans."""
        return 0

    def reusable(self, take: Sequence[Sequence[int]] = ()) -> tuple[int, int]:
        """Free page ids no kept prefix holds (taking up to that many evicts no kept
        prefix), and the state pages among them: spans with no page in use or kept, nor
        any page of ``take`` (a hit's per-group tables, which it is about to take).

        Here every page is one id, so the two counts are equal; O(1).
        """
        num = self._free.num_reusable
        return num, num

    def page_ids_in(self, tables: Sequence[Sequence[int]]) -> int:
        """Page ids the pages of these per-group tables cover (the null block skipped)."""
        return sum(
            self.widths[group] * sum(1 for page in table if page)
            for group, table in enumerate(tables)
        )

    def ref_count(self, page: int) -> int:
        """References held on ``page`` by request tables."""
        return self._ref[page]

    def is_free(self, page: int) -> bool:
        """Whether ``page`` is free (in the free queue)."""
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
        self.take_tables([[page] if g == group else [] for g in range(len(self.widths))])

    def take_tables(self, tables: Sequence[Sequence[int]]) -> None:
        """Add a reference to every page of a hit's per-group tables (the null block
        skipped), pulling free ones off the free queue."""
        ref, used, widths = self._ref, self.num_used_per_group, self.widths
        freed = []
        for group, table in enumerate(tables):
            for page in table:
                if not page:
                    continue
                if not ref[page]:
                    freed.append(page)
                    used[group] += 1
                    self._num_free -= widths[group]
                    self._reused(page, group)
                ref[page] += 1
        self._free.remove_all(freed)

    def _reused(self, page: int, group: int) -> None:
        """Hook: a free page of ``group`` is in use again."""

    def num_reusable_in(self, tables: Sequence[Sequence[int]]) -> int:
        """Page ids of these per-group tables that are free and held by no kept prefix."""
        ref, is_kept, widths = self._ref, self._free.is_kept, self.widths
        return sum(
            widths[group]
            for group, table in enumerate(tables)
            for page in table
            if page and not ref[page] and not is_kept(page)
        )

    def fits(
        self,
        num_small: int,
        num_states: int,
        *,
        take: Sequence[Sequence[int]] = (),
        release: Sequence[tuple[int, int]] = (),
    ) -> bool:
        """Whether ``num_small`` pages and ``num_states`` state pages can be taken once the
        pages of ``take`` (per-group tables, as :meth:`take_tables`) are taken and the
        ``(group, page)`` pairs of ``release`` released (once each)."""
        ref = self._ref
        free = self._num_free
        free -= sum(1 for table in take for page in table if page and not ref[page])
        free += sum(1 for _, page in release if ref[page] == 1)
        return num_small + num_states <= free

    def allocate(self, num: int, group: int) -> list[int]:
        """Take ``num`` pages for ``group``, evicting the hashes they held.

        The caller has checked :meth:`fits`.
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
                if self.events is not None:
                    self.events.removed(owner[page], old)
            ref[page] = 1
            owner[page] = group
        used = self.num_used_per_group
        for group in groups:
            used[group] += num
        self._num_free -= len(pages)
        return out

    def release(self, pages: Iterable[int], group: int | None = None) -> None:
        """Drop one reference on each page; pages at zero become free.

        ``group``: the group of every page, or None for pages of several groups. Unhashed
        pages are reused first (nothing to lose), then hashed pages no kept prefix needs,
        in the order released (pass a request's later blocks first), then pages of kept
        prefixes.
        """
        freed = self._drop_refs(pages)
        if group is not None:
            self.num_used_per_group[group] -= len(freed)
        else:
            used, owner = self.num_used_per_group, self._group
            for page in freed:
                used[owner[page]] -= 1
        self._num_free += len(freed)
        self._free.push(freed, self._hash)

    def _drop_refs(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference on each page; returns those at zero."""
        ref = self._ref
        freed: list[int] = []
        append = freed.append
        for page in pages:
            count = ref[page] - 1
            ref[page] = count
            if not count:
                append(page)
        return freed

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

    @property
    def eviction_order(self) -> EvictionOrder:
        """The order in which kept prefixes give up pages; its clock counts demand."""
        return self._free.order

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
        if self.events is not None:  # no tokens here: reported as a tier's store is
            self.events.stored_keys(DEVICE, [(group, block_hash)])
        return True

    def cache_blocks(
        self,
        tables: Sequence[Sequence[int]],
        hashes: Sequence[BlockHash],
        start: int,
        stop: int,
        token_ids: Sequence[int] = (),
    ) -> int:
        """Cache blocks ``start .. stop-1`` of every group's table (as :meth:`cache`);
        ``token_ids``, the request's tokens, go into the events reported.

        Returns how many of those pages stayed uncached (their block was cached before).
        """
        page_hash, owner, maps = self._hash, self._group, self._cached
        num_uncached = 0
        new: list[tuple[int, int]] | None = None if self.events is None else []
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
                if new is not None:
                    new.append((group, i))
        if new:
            self._report_stored(new, hashes, token_ids)
        return num_uncached

    def _report_stored(
        self, new: list[tuple[int, int]], hashes: Sequence[BlockHash], token_ids: Sequence[int]
    ) -> None:
        """Report the (group, block) pairs just cached as runs of consecutive blocks."""
        assert self.events is not None
        new.sort()
        first = 0
        for k in range(1, len(new) + 1):
            if k == len(new) or new[k] != (new[k - 1][0], new[k - 1][1] + 1):
                group, start = new[first]
                self.events.stored(group, hashes, start, new[k - 1][1] + 1, token_ids)
                first = k

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
        if self.events is not None:
            self.events.removed(self._group[page], block_hash)
        if page in self._free:
            self._free.remove_all((page,))
            self._free_unhashed(page)

    def _free_unhashed(self, page: int) -> None:
        """Hook: a free page that holds no block any more goes where such pages wait."""
        self._free.push((page,), self._hash)

    def check_integrity(self) -> None:
        """Assert the pool's own invariants (tests call it after every operation)."""
        assert self._ref[0] == 0 and 0 not in self._free and self._hash[0] is None
        widths, owner = self.widths, self._group
        in_use = [p for p in range(1, self.num_blocks) if self._ref[p]]
        for page in range(1, self.num_blocks):
            assert self._ref[page] >= 0, page
        for group, table in enumerate(self._cached):
            for block_hash, page in table.items():
                assert self._hash[page] == block_hash and self._group[page] == group
        num_cached = sum(1 for h in self._hash if h is not None)
        assert num_cached == sum(len(t) for t in self._cached)
        assert self.num_used_per_group == [
            sum(1 for p in in_use if owner[p] == g) for g in range(len(widths))
        ]
        held = sum(widths[owner[p]] for p in in_use)
        assert held == self.num_blocks - 1 - self._num_free, (held, self._num_free)
        self._free.check_integrity(self._hash)
        self._check_free_pages()

    def _check_free_pages(self) -> None:
        for page in range(1, self.num_blocks):
            assert (self._ref[page] == 0) == (page in self._free), page
        assert self._num_free == len(self._free)
