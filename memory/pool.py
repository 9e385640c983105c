"""The block pool: N small pages shared by every KV group, page 0 the null block.

K/V groups take one page per block. Where the pool has state groups whose state needs more
bytes than a page (``widths``), a state page is a span of that many pages, aligned and
named by its first id, carved from the same ids (``hybridkv.memory.spans``); one free
queue orders every free cached page, small or state, for eviction.

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
from hybridkv.memory.spans import Spans

BlockId = NewType("BlockId", int)

#: Stands in the table for a block that is not held (released by its policy, never needed).
NULL_BLOCK = BlockId(0)


class BlockPool:
    """Pages, their reference counts, the free queue and the prefix-cache map.

    Every method is O(pages touched). The pool never decides what to free: the KV cache
    manager does, and the pool keeps the bookkeeping exact (see :meth:`check_integrity`).

    Args:
        num_blocks: Page ids, the null page 0 included.
        num_groups: KV groups.
        widths: Per group, the page ids one of its pages takes: 1 for K/V groups, the
            state span for state groups (one value above 1 at most, dividing
            ``num_blocks``); None: 1 for every group.
    """

    def __init__(
        self, num_blocks: int, num_groups: int, *, widths: Sequence[int] | None = None
    ) -> None:
        if num_blocks < 2:
            raise LayoutError(f"a block pool needs >= 2 pages (page 0 is null), got {num_blocks}")
        widths = tuple(widths) if widths is not None else (1,) * num_groups
        spans = sorted(set(widths) - {1})
        if len(widths) != num_groups or any(w < 1 for w in widths) or len(spans) > 1:
            raise LayoutError(f"page widths must be 1 or one state span per group, got {widths}")
        self.widths = widths
        #: Page ids of one state page (1: every page is one id).
        self.span = spans[0] if spans else 1
        if num_blocks % self.span or num_blocks < 2 * self.span:
            raise LayoutError(
                f"a pool of state pages of {self.span} ids needs a multiple of {self.span} "
                f"ids, at least two spans (span 0 holds the null page), got {num_blocks}"
            )
        self._spans = Spans(num_blocks, self.span) if self.span > 1 else None
        self._num_free = num_blocks - 1
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        # The cache key of a page, split in two lists: its hash (or None) and its group,
        # which is also the group its holders use it for.
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._group = [0] * num_blocks
        self._cached: list[dict[BlockHash, int]] = [{} for _ in range(num_groups)]
        self._free = FreeQueue(num_blocks, start_empty=self._spans is not None)
        self.num_used_per_group = [0] * num_groups
        #: Pages that lost their hash through :meth:`uncache` so far (a change counter).
        self.num_uncached = 0

    @property
    def num_free(self) -> int:
        """Page ids that an allocation may take (cached free pages included)."""
        return self._num_free

    @property
    def num_free_spans(self) -> int:
        """State pages that could be taken now, evicting cached pages where needed (every
        span free of pages in use); 0 in a pool without state spans."""
        return self._spans.num_whole_free if self._spans is not None else 0

    @property
    def spans(self) -> Spans | None:
        """The span bookkeeping of a pool with state spans (read it, never change it)."""
        return self._spans

    def reusable(self, take: Sequence[Sequence[int]] = ()) -> tuple[int, int]:
        """Free page ids no kept prefix holds (taking up to that many evicts no kept
        prefix), and the state pages among them: spans with no page in use or kept, nor
        any page of ``take`` (a hit's per-group tables, which it is about to take).

        O(1) in a pool without state spans (the spans count is then the ids count); with
        them a scan of the free spans, for the planner's chunk sizing of a pool that also
        has window groups.
        """
        spans = self._spans
        if spans is None:
            num = self._free.num_reusable
            return num, num
        ids = spans.num_holes
        k, is_kept, widths, owner = spans.span, self._free.is_kept, self.widths, self._group
        for page in self._free.reusable_pages():
            ids += widths[owner[page]]
        taken = {page // k for table in take for page in table if page}
        num_spans = 0
        for s in range(1, self.num_blocks // k):
            if spans.used(s) or s in taken:
                continue
            num_spans += not any(is_kept(p) for p in range(s * k, s * k + k))
        return ids, num_spans

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
        """Whether ``page`` sits in the free queue, or is a hole of a pool with spans."""
        if page in self._free:
            return True
        spans = self._spans
        return spans is not None and spans.is_hole(page)

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
        ref, used, widths, spans = self._ref, self.num_used_per_group, self.widths, self._spans
        freed = []
        for group, table in enumerate(tables):
            for page in table:
                if not page:
                    continue
                if not ref[page]:
                    freed.append(page)
                    used[group] += 1
                    self._num_free -= widths[group]
                    if spans is not None:
                        if widths[group] > 1:
                            spans.use_state(page)
                        else:
                            spans.use_small(page)
                ref[page] += 1
        self._free.remove_all(freed)

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
        """Whether ``num_small`` small pages and ``num_states`` state pages can be taken
        once the pages of ``take`` (per-group tables, as :meth:`take_tables`) are taken
        and the ``(group, page)`` pairs of ``release`` released (once each)."""
        ref, widths, spans = self._ref, self.widths, self._spans
        free = self._num_free
        changes: dict[int, int] = {}
        for group, table in enumerate(take):
            width = widths[group]
            for page in table:
                if page and not ref[page]:
                    free -= width
                    if spans is not None:
                        s = page // spans.span
                        changes[s] = changes.get(s, 0) + width
        for group, page in release:
            if ref[page] == 1:
                width = widths[group]
                free += width
                if spans is not None:
                    s = page // spans.span
                    changes[s] = changes.get(s, 0) - width
        if spans is None:
            return num_small + num_states <= free
        whole = spans.whole_free_after(changes) if changes else spans.num_whole_free
        return num_states <= whole and num_small + num_states * spans.span <= free

    def allocate(self, num: int, group: int) -> list[int]:
        """Take ``num`` pages for ``group``, evicting the hashes they held.

        The caller has checked :meth:`fits`.
        """
        return self.allocate_groups(num, (group,))[0]

    def allocate_groups(self, num: int, groups: Sequence[int]) -> tuple[list[int], ...]:
        """Take ``num`` pages for each of ``groups`` at once (see :meth:`allocate`).

        With state spans, state groups take theirs first: a small page never breaks the
        span a state page of the same call was counted on.
        """
        if self._spans is not None:
            return self._allocate_spans(num, groups)
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
        self._num_free -= len(pages)
        return out

    def _allocate_spans(self, num: int, groups: Sequence[int]) -> tuple[list[int], ...]:
        out: dict[int, list[int]] = {}
        widths = self.widths
        for group in sorted(groups, key=lambda g: widths[g] == 1):
            pages = self._take_states(num) if widths[group] > 1 else self._take_small(num)
            for page in pages:
                self._ref[page] = 1
                self._group[page] = group
            self.num_used_per_group[group] += num
            self._num_free -= num * widths[group]
            out[group] = pages
        return tuple(out[group] for group in groups)

    def _evict_next(self) -> int:
        """The next free cached page in eviction order, its hash evicted (a hole-less
        pool with spans; the caller makes it a hole, or uses it)."""
        page = self._free.take(1)[0]
        old = self._hash[page]
        assert old is not None, page
        del self._cached[self._group[page]][old]
        self._hash[page] = None
        return page

    def _is_state_page(self, page: int) -> bool:
        return self.widths[self._group[page]] > 1

    def _take_small(self, num: int) -> list[int]:
        """Holes first (spans in use first), then cached pages in eviction order: a state
        page evicted that way turns into a span of holes."""
        spans = self._spans
        assert spans is not None
        pages = spans.take_holes(num)
        while len(pages) < num:
            page = self._evict_next()
            if self._is_state_page(page):
                spans.state_to_holes(page)
                pages += spans.take_holes(num - len(pages))
            else:
                spans.use_small(page)
                pages.append(page)
        return pages

    def _take_states(self, num: int) -> list[int]:
        """Empty spans first; then cached pages are evicted in eviction order until a
        span is empty: a state page is reused as it is, a small page becomes a hole."""
        spans = self._spans
        assert spans is not None
        pages: list[int] = []
        while len(pages) < num:
            page = spans.take_empty()
            if page is not None:
                pages.append(page)
                continue
            page = self._evict_next()
            if self._is_state_page(page):
                spans.use_state(page)
                pages.append(page)
            else:
                spans.add_hole(page)
        return pages

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
        used, owner, widths = self.num_used_per_group, self._group, self.widths
        if group is not None and self._spans is None:
            used[group] -= len(freed)
            self._num_free += len(freed)
        else:
            for page in freed:
                g = owner[page]
                used[g] -= 1
                self._num_free += widths[g]
        spans = self._spans
        if spans is None:
            self._free.push(freed, self._hash)
            return
        hashes = self._hash
        for page in freed:
            is_state = widths[owner[page]] > 1
            if is_state:
                spans.release_state(page)
            else:
                spans.release_small(page)
            if hashes[page] is not None:
                self._free.push((page,), hashes)
            elif is_state:
                spans.state_to_holes(page)
            else:
                spans.add_hole(page)

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
        if page not in self._free:
            return
        self._free.remove_all((page,))
        spans = self._spans
        if spans is None:
            self._free.push((page,), self._hash)
        elif self._is_state_page(page):
            spans.state_to_holes(page)
        else:
            spans.add_hole(page)

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
        spans = self._spans
        if spans is None:
            for page in range(1, self.num_blocks):
                assert (self._ref[page] == 0) == (page in self._free), page
            assert self._num_free == len(self._free)
            return
        k = spans.span
        per_span_used = [0] * (self.num_blocks // k)
        per_span_queued = [0] * (self.num_blocks // k)
        per_span_used[0] = 1
        for page in range(1, self.num_blocks):
            queued = page in self._free
            assert not (queued and self._ref[page]), page
            if not (queued or self._ref[page]):
                continue
            width = widths[owner[page]]
            assert width == 1 or page % k == 0, ("a state page off its span", page)
            (per_span_queued if queued else per_span_used)[page // k] += width
            assert not queued or self._hash[page] is not None, ("a hole in the queue", page)
        spans.check_integrity(per_span_used, per_span_queued)
