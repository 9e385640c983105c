"""Free pages in eviction order, and the kept prefixes that decide that order.

A free page that carries a block hash is worth keeping only while some prefix a future
request can resume from needs it, in every group: a full-attention group needs every
block of the prefix, a sliding-window group only the blocks its window reads before the
prefix's end. The queue keeps such prefixes (:class:`KeptPrefix`, chosen by
``hybridkv.memory.retention``), counts per page how many hold it, and splits free pages::

    cold                                 given up                 warm
    [ unhashed | hashed, held by no  ]   [ pages kept prefixes ]  { held by a kept
    [ kept prefix, least recent first ]  [ gave up, in order   ]    prefix }
    taken first --------------------------------------------------------> taken last

When cold and given-up pages run out, a kept prefix gives up pages: the one whose next
resume is predicted farthest off (``hybridkv.memory.eviction_order``). A prefix whose
every group needs all of its blocks (full attention, or a window longer than the prefix)
is *nested*: dropping its last block leaves a prefix one block
shorter that still resumes, so it gives up blocks from its end, every group's page of a
block together. Any other prefix is a *unit*: one lost page loses the whole resume point,
so it gives up all its pages at once, and they are reused before any other kept prefix
loses a page. A page another kept prefix holds stays warm. Given-up pages stay cached
until reused: a hit still finds them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from hybridkv.memory.eviction_order import EvictionOrder, KeptPrefix
from hybridkv.memory.hashing import BlockHash

__all__ = ["FreeQueue", "KeptPrefix"]

#: Pages a nested prefix gives up at least, once it must give up any: the bookkeeping
#: of shrinking it is paid once per run of blocks rather than per page.
_MIN_GIVE_UP = 8


class FreeQueue:
    """Free pages (cold, given up, then warm) and the prefixes kept for future hits.

    Page ids are ``1 .. num_blocks - 1``; all start cold (none with ``start_empty``).
    Every method is O(pages touched), amortized, except :meth:`forget` (a failed step's
    pages), which scans the kept prefixes.
    """

    def __init__(self, num_blocks: int, *, start_empty: bool = False) -> None:
        # A pool with state spans keeps its never-cached pages as holes, not here.
        first = range(0) if start_empty else range(1, num_blocks)
        self._cold: OrderedDict[int, None] = OrderedDict.fromkeys(first)
        self._given_up: OrderedDict[int, None] = OrderedDict()
        self._warm: dict[int, None] = {}  # a dict: stores and deletes are not method calls
        self._count = [0] * num_blocks  # kept prefixes holding each page
        self._order = EvictionOrder(horizon=num_blocks, max_ghosts=num_blocks)
        self._by_key: dict[BlockHash, KeptPrefix] = {}

    def __len__(self) -> int:
        return len(self._cold) + len(self._given_up) + len(self._warm)

    def __contains__(self, page: int) -> bool:
        return page in self._cold or page in self._warm or page in self._given_up

    @property
    def num_reusable(self) -> int:
        """Free pages no kept prefix holds: taking up to this many evicts no prefix."""
        return len(self._cold) + len(self._given_up)

    def reusable_pages(self) -> Iterable[int]:
        """The free pages no kept prefix holds (cold, then given up)."""
        yield from self._cold
        yield from self._given_up

    @property
    def order(self) -> EvictionOrder:
        """The kept prefixes' eviction order (its clock is advanced by the KV cache
        manager, which counts the tokens requests are given slots for)."""
        return self._order

    def is_kept(self, page: int) -> bool:
        """Whether some kept prefix holds ``page``."""
        return self._count[page] > 0

    def find(self, key: BlockHash) -> KeptPrefix | None:
        """The kept prefix whose last block hashes to ``key``, if any."""
        return self._by_key.get(key)

    def kept_prefixes(self) -> Iterable[KeptPrefix]:
        """Every prefix kept now."""
        return self._order

    # -- pages -------------------------------------------------------------------------

    def push(self, pages: Iterable[int], hashes: Sequence[BlockHash | None]) -> None:
        """Pages became free: warm if kept; else cold, unhashed ones at the very front.

        ``hashes[page]`` is the page's block hash, or None.
        """
        cold, warm, count = self._cold, self._warm, self._count
        for page in pages:
            if hashes[page] is None:
                cold[page] = None
                cold.move_to_end(page, last=False)
            elif count[page]:
                warm[page] = None
            else:
                cold[page] = None

    def remove_all(self, pages: Iterable[int]) -> None:
        """A prefix hit takes ``pages`` (free ones) back from the queue."""
        cold, given_up, warm = self._cold, self._given_up, self._warm
        for page in pages:
            if page in cold:
                del cold[page]
            elif page in warm:
                del warm[page]
            else:
                del given_up[page]

    def take(self, num: int) -> list[int]:
        """The next ``num`` pages to reuse; the caller has checked ``num <= len(self)``.

        Cold pages first, then given-up ones; when none are left, kept prefixes give up
        pages in :class:`EvictionOrder`'s order. The caller evicts the pages' hashes.
        """
        cold = self._cold
        popitem = cold.popitem
        pages: list[int] = []
        append = pages.append
        if len(cold) >= num:
            for _ in range(num):
                append(popitem(last=False)[0])
            return pages
        given_up = self._given_up
        while len(pages) < num:
            if cold:
                append(popitem(last=False)[0])
            elif given_up:
                append(given_up.popitem(last=False)[0])
            else:  # the pages given up serve this call first, the rest wait in order
                need = num - len(pages)
                victim = self._order.victim()
                freed = self._give_up(victim, need)
                if victim not in self._order:
                    self._order.remember(victim)
                pages += freed[:need]
                given_up.update(dict.fromkeys(freed[need:]))
        return pages

    def forget(self, page: int) -> None:
        """``page`` loses its contents: every prefix holding it shrinks below it or goes.

        Rare (a failed step), so it scans the kept prefixes instead of indexing pages.
        """
        if not self._count[page]:
            return
        for prefix in list(self._order):
            held = prefix.held_pages
            if page not in held:
                continue
            num_blocks = 0
            if prefix.num_groups:  # nested: keep the blocks before this page's block
                pos = prefix.cursor + held.index(page)
                num_blocks = prefix.first_num_blocks - 1 - pos // prefix.num_groups
            self._cold.update(dict.fromkeys(self._shrink(prefix, num_blocks)))

    # -- prefixes ----------------------------------------------------------------------

    def keep(self, prefix: KeptPrefix, *, in_use: bool = False, pinned: bool = False) -> KeptPrefix:
        """Keep ``prefix``'s pages for future hits, used now.

        ``in_use``: every page is held by a request now, so none is free to move;
        ``pinned``: by a running request, until it calls :meth:`release`. Returns the
        prefix kept: an equal one (same key) already kept is used instead, and a branch
        makes it a branch.
        """
        kept = self._by_key.setdefault(prefix.key, prefix)
        if kept is not prefix:
            kept.is_branch |= prefix.is_branch
            if pinned:
                self._order.resume(kept)
            else:
                self._order.used(kept)
            return kept
        self._order.add(prefix, pinned=pinned)
        count = self._count
        if in_use:
            for page in prefix.pages:
                count[page] += 1
            return prefix
        cold, given_up, warm = self._cold, self._given_up, self._warm
        for page in prefix.pages:
            count[page] += 1
            if page in cold:
                del cold[page]
                warm[page] = None
            elif page in given_up:
                del given_up[page]
                warm[page] = None
        return prefix

    def resume(self, prefix: KeptPrefix) -> None:
        """A request resumed from kept ``prefix``: pinned until it calls :meth:`release`."""
        self._order.resume(prefix)

    def release(self, prefix: KeptPrefix) -> None:
        """A request that pinned ``prefix`` ended (it may have been given up since)."""
        self._order.release(prefix)

    def recall(self, hashes: Sequence[BlockHash]) -> int:
        """The reuse distance of the longest prefix of ``hashes`` that eviction gave up."""
        return self._order.recall(hashes)

    def let_go(self, prefix: KeptPrefix, *, in_use: bool = False) -> None:
        """Stop keeping ``prefix`` (a request continues from it); unheld pages go cold.

        ``in_use``: every page it holds is held by a request now, so none is free to move.
        A prefix no longer kept (given up meanwhile) is left alone.
        """
        if prefix in self._order:
            self._cold.update(dict.fromkeys(self._shrink(prefix, 0, in_use=in_use)))

    def extend(
        self,
        prefix: KeptPrefix,
        hashes: Sequence[BlockHash],
        pages: list[int],
        num_blocks: int,
    ) -> bool:
        """Grow a kept nested ``prefix`` to ``num_blocks`` blocks of the path ``hashes``.

        ``pages``: the new blocks' pages, last block first, all held by a request. False,
        with nothing changed, if ``prefix`` is no longer kept whole, or another prefix of
        that length is kept already.
        """
        key = hashes[num_blocks - 1]
        if prefix not in self._order or prefix.cursor:
            return False
        if self._by_key.get(key, prefix) is not prefix:
            return False
        del self._by_key[prefix.key]
        count = self._count
        for page in pages:
            count[page] += 1
        prefix.hashes = hashes
        prefix.pages = pages + prefix.pages
        prefix.num_blocks = prefix.first_num_blocks = num_blocks
        prefix.is_carried = False
        self._by_key[key] = prefix
        return True

    def _give_up(self, prefix: KeptPrefix, num: int) -> list[int]:
        """Evict from ``prefix`` until ``num`` free pages are no longer kept, or all of it;
        returns those pages, in eviction order, out of the warm part.

        A nested prefix drops blocks from its end, as few as give ``num`` free pages that
        no other prefix holds, and at least ``_MIN_GIVE_UP``: the bookkeeping of a shrink
        is paid once per run, and pages given up stay cached until reused, so a hit still
        finds them. A unit drops everything.
        """
        num_groups = prefix.num_groups
        if not num_groups:
            return self._shrink(prefix, 0)
        count, warm, pages = self._count, self._warm, prefix.pages
        num_blocks = prefix.num_blocks
        num = max(num, _MIN_GIVE_UP)
        for start in range(prefix.cursor, len(pages), num_groups):
            num_blocks -= 1
            for page in pages[start : start + num_groups]:
                if count[page] == 1 and page in warm:
                    num -= 1
            if num <= 0:
                return self._shrink(prefix, num_blocks)
        return self._shrink(prefix, 0)

    def _shrink(self, prefix: KeptPrefix, num_blocks: int, *, in_use: bool = False) -> list[int]:
        """``prefix`` now resumes after ``num_blocks`` blocks (0: not at all); returns its
        free pages that no kept prefix holds any more, taken out of the warm part
        (``in_use``: the caller knows none is free)."""
        del self._by_key[prefix.key]
        stop = len(prefix.pages)
        if num_blocks > 0:
            prefix.num_blocks = num_blocks
            if self._by_key.setdefault(prefix.key, prefix) is prefix:
                stop = (prefix.first_num_blocks - num_blocks) * prefix.num_groups
            else:
                num_blocks = 0  # an equal, shorter prefix is kept already
        if num_blocks == 0:
            self._order.remove(prefix)
        warm, count = self._warm, self._count
        freed: list[int] = []
        if in_use:
            for page in prefix.pages[prefix.cursor : stop]:
                count[page] -= 1
        else:
            for page in prefix.pages[prefix.cursor : stop]:
                count[page] -= 1
                if not count[page] and page in warm:
                    del warm[page]
                    freed.append(page)
        prefix.cursor = stop
        return freed

    def check_integrity(self, hashes: Sequence[BlockHash | None]) -> None:
        """Assert the queue's invariants (``hashes[page]``: the page's hash or None)."""
        parts = (self._cold.keys(), self._given_up.keys(), self._warm.keys())
        assert sum(map(len, parts)) == len(set().union(*parts)), "a page in two parts"
        count = [0] * len(self._count)
        self._order.check_integrity()
        for prefix in self._order:
            assert self._by_key[prefix.key] is prefix
            for page in prefix.held_pages:
                assert hashes[page] is not None, page
                count[page] += 1
        assert count == self._count
        assert len(self._by_key) == len(self._order)
        for page in self._warm:
            assert count[page], page
        for page in (*self._cold, *self._given_up):
            assert not count[page], page
