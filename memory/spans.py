"""Two page sizes in one pool: small pages for K/V, spans of them for states.

A Mamba2 state is megabytes while 16 tokens of an attention layer's K/V are kilobytes.
Rather than raising every group's block until one K/V page holds a state (what a single
page size forces, and the cliff of hundreds of tokens per block that comes with it), the
pool counts in small pages and gives a state group a *span*: ``k`` consecutive small
pages, aligned, named by its first page id::

    page ids   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15     k = 4: four spans
    span       0       | 1       | 2         | 3
    holds      n a a . | [ s   ] | a . . a   | . . . .
               n: null page, a: a K/V page in use, s: a state page (ids 4-7), .: free

Span 0 holds the null page, so it only ever serves small pages. A state page needs a span
no page of which is in use. Small pages are taken from free pages nobody caches
(*holes*), in spans that already have a page in use first, so that in-use pages pack into
few spans and whole free spans stay whole for states; a span whose pages are all free
holes (*empty*) is broken only when no other hole is left.

:class:`Spans` is the bookkeeping of that picture for :class:`~hybridkv.memory.pool.BlockPool`:
pages in use per span, the holes, and which spans are free of pages in use. Free pages that
carry a cached block (small pages, or whole state pages) are not holes: they wait in the
pool's free queue, in eviction order, and become holes when eviction takes them.
"""

from __future__ import annotations

from collections.abc import Iterator


class Spans:
    """Pages in use and holes per span of ``span`` pages, over ``num_blocks`` page ids.

    ``num_blocks`` must be a multiple of ``span``. Every id but the null page starts a hole.
    """

    def __init__(self, num_blocks: int, span: int) -> None:
        assert span > 1 and num_blocks % span == 0, (num_blocks, span)
        self.span = span
        num_spans = num_blocks // span
        self._used = [0] * num_spans  # page ids in use (a state page in use counts span)
        self._used[0] = 1  # the null page: span 0 never holds a state
        self._holes = [list(range(s * span, (s + 1) * span)) for s in range(num_spans)]
        self._holes[0].remove(0)
        # Spans with holes, by what taking one costs: none (some page in use already),
        # a whole free span with cached pages, a whole free span of holes only.
        self._partial: dict[int, None] = {0: None}
        self._idle: dict[int, None] = {}
        self._empty: dict[int, None] = dict.fromkeys(range(1, num_spans))
        self.num_holes = num_blocks - 1
        #: Spans with no page in use: each can become a state page.
        self.num_whole_free = num_spans - 1

    def used(self, span_index: int) -> int:
        """Page ids in use in span ``span_index``."""
        return self._used[span_index]

    def is_hole(self, page: int) -> bool:
        """Whether ``page`` is a hole."""
        return page in self._holes[page // self.span]

    def holes(self) -> Iterator[int]:
        """Every hole, span by span."""
        for holes in self._holes:
            yield from holes

    # -- small pages ---------------------------------------------------------------------

    def take_holes(self, num: int) -> list[int]:
        """Up to ``num`` holes as small pages in use, cheapest spans first."""
        out: list[int] = []
        while len(out) < num:
            tier = self._partial or self._idle or self._empty
            if not tier:
                break
            s = next(iter(tier))
            holes = self._holes[s]
            grab = min(num - len(out), len(holes))
            out += holes[len(holes) - grab :]
            del holes[len(holes) - grab :]
            self._use(s, grab)
        self.num_holes -= len(out)
        return out

    def add_hole(self, page: int) -> None:
        """A free small page no block is cached in any more: a hole (its use already
        given back with :meth:`release_small` or never counted)."""
        s = page // self.span
        self._holes[s].append(page)
        self.num_holes += 1
        self._place(s)

    def use_small(self, page: int) -> None:
        """A free small page with a cached block is in use again (a hit, a reuse)."""
        self._use(page // self.span, 1)

    def release_small(self, page: int) -> None:
        """A small page is no longer in use (it becomes a hole or waits cached)."""
        self._use(page // self.span, -1)

    # -- state pages ---------------------------------------------------------------------

    def take_empty(self) -> int | None:
        """The first page of an empty span, now a state page in use; None if no span is
        empty."""
        if not self._empty:
            return None
        s = next(iter(self._empty))
        self._holes[s].clear()
        self.num_holes -= self.span
        self._use(s, self.span)
        return s * self.span

    def use_state(self, page: int) -> None:
        """A free state page (its span free of holes) is in use again."""
        self._use(page // self.span, self.span)

    def release_state(self, page: int) -> None:
        """A state page is no longer in use: it waits cached in the free queue."""
        self._use(page // self.span, -self.span)

    def state_to_holes(self, page: int) -> None:
        """A free state page lost its block: its span's pages are holes."""
        s = page // self.span
        self._holes[s] = list(range(s * self.span, (s + 1) * self.span))
        self.num_holes += self.span
        self._place(s)

    # -- bookkeeping ---------------------------------------------------------------------

    def whole_free_after(self, changes: dict[int, int]) -> int:
        """:attr:`num_whole_free` once the uses in ``changes`` (span -> ids) are made."""
        used = self._used
        return self.num_whole_free + sum(
            (used[s] + d == 0) - (used[s] == 0) for s, d in changes.items()
        )

    def _use(self, s: int, num: int) -> None:
        before = self._used[s]
        after = self._used[s] = before + num
        if (before == 0) != (after == 0):
            self.num_whole_free += 1 if after == 0 else -1
        self._place(s)

    def _place(self, s: int) -> None:
        self._partial.pop(s, None)
        self._idle.pop(s, None)
        self._empty.pop(s, None)
        holes = len(self._holes[s])
        if not holes:
            return
        if self._used[s]:
            self._partial[s] = None
        elif holes == self.span:
            self._empty[s] = None
        else:
            self._idle[s] = None

    def check_integrity(self, in_use: list[int], free_queued: list[int]) -> None:
        """Assert the counts (``in_use``/``free_queued``: per span, ids in use and ids
        waiting cached in the free queue)."""
        k = self.span
        assert self._used == in_use, "pages in use per span"
        holes = [len(h) for h in self._holes]
        assert self.num_holes == sum(holes)
        for s, (u, q, h) in enumerate(zip(in_use, free_queued, holes, strict=True)):
            assert u + q + h == k, ("span not covered once", s, u, q, h)
            assert all(p // k == s for p in self._holes[s])
            tiers = (s in self._partial, s in self._idle, s in self._empty)
            expected = (h > 0 and u > 0, h > 0 and u == 0 and h < k, h == k)
            assert tiers == expected, (s, tiers, expected)
        assert self.num_whole_free == sum(1 for u in in_use if u == 0)
