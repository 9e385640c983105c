"""The block pool with two page sizes: K/V pages, and state pages that span several.

:class:`SpanPool` is a :class:`~hybridkv.memory.pool.BlockPool` whose state groups take a
span of ``span`` pages per page (``hybridkv.memory.spans`` has the picture). What changes:

* never-cached free pages are *holes*, kept per span rather than in the free queue, so a
  K/V page is taken from a span already in use before an empty span is broken;
* a state page needs an empty span: if none is, cached pages are evicted in the free
  queue's order (one eviction order for both sizes) until a span is empty; a state page
  evicted that way is reused as it is, a K/V page becomes a hole;
* :meth:`fits` counts both: page ids, and spans with no page in use.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hybridkv.memory.errors import LayoutError
from hybridkv.memory.pool import BlockPool
from hybridkv.memory.spans import Spans


def make_pool(num_blocks: int, num_groups: int, widths: Sequence[int]) -> BlockPool:
    """A pool for groups whose pages take ``widths`` page ids each (1 for K/V groups, the
    state span for state groups): a :class:`SpanPool` where a span is above 1."""
    if any(w != 1 for w in widths):
        return SpanPool(num_blocks, num_groups, widths)
    return BlockPool(num_blocks, num_groups)


class SpanPool(BlockPool):
    """A block pool whose state groups' pages span ``span`` page ids.

    Args:
        num_blocks: Page ids, the null page 0 included; a multiple of the span.
        num_groups: KV groups.
        widths: Per group, 1 (K/V) or the span (one value above 1).
    """

    _HOLES = True

    def __init__(self, num_blocks: int, num_groups: int, widths: Sequence[int]) -> None:
        widths = tuple(widths)
        spans = sorted(set(widths) - {1})
        if len(widths) != num_groups or any(w < 1 for w in widths) or len(spans) != 1:
            raise LayoutError(f"page widths must be 1 or one state span per group, got {widths}")
        span = spans[0]
        if num_blocks % span or num_blocks < 2 * span:
            raise LayoutError(
                f"a pool of state pages of {span} ids needs a multiple of {span} ids, at "
                f"least two spans (span 0 holds the null page), got {num_blocks}"
            )
        super().__init__(num_blocks, num_groups)
        self.widths = widths
        self.span = span
        self.spans = Spans(num_blocks, span)  # read it, never change it from outside

    @property
    def num_free_spans(self) -> int:
        return self.spans.num_whole_free

    def is_free(self, page: int) -> bool:
        return page in self._free or self.spans.is_hole(page)

    def reusable(self, take: Sequence[Sequence[int]] = ()) -> tuple[int, int]:
        """As :meth:`BlockPool.reusable`; a scan of the free spans, for the planner's chunk
        sizing of a pool that also has window groups."""
        spans = self.spans
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

    def fits(
        self,
        num_small: int,
        num_states: int,
        *,
        take: Sequence[Sequence[int]] = (),
        release: Sequence[tuple[int, int]] = (),
    ) -> bool:
        ref, widths, k = self._ref, self.widths, self.span
        free = self._num_free
        changes: dict[int, int] = {}  # span -> change in page ids in use
        for group, table in enumerate(take):
            width = widths[group]
            for page in table:
                if page and not ref[page]:
                    free -= width
                    changes[page // k] = changes.get(page // k, 0) + width
        for group, page in release:
            if ref[page] == 1:
                width = widths[group]
                free += width
                changes[page // k] = changes.get(page // k, 0) - width
        whole = self.spans.whole_free_after(changes) if changes else self.spans.num_whole_free
        return num_states <= whole and num_small + num_states * k <= free

    def _reused(self, page: int, group: int) -> None:
        if self.widths[group] > 1:
            self.spans.use_state(page)
        else:
            self.spans.use_small(page)

    def allocate_groups(self, num: int, groups: Sequence[int]) -> tuple[list[int], ...]:
        """Take ``num`` pages for each of ``groups``; state groups take theirs first, so a
        K/V page never breaks the span a state page of the same call was counted on."""
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
        """The next free cached page in eviction order, its block evicted (the caller
        makes it a hole, or uses it)."""
        page = self._free.take(1)[0]
        old = self._hash[page]
        assert old is not None, page
        del self._cached[self._group[page]][old]
        self._hash[page] = None
        if self.events is not None:
            self.events.removed(self._group[page], old)
        return page

    def _is_state_page(self, page: int) -> bool:
        return self.widths[self._group[page]] > 1

    def _take_small(self, num: int) -> list[int]:
        """Holes first (spans in use first), then cached pages in eviction order: a state
        page evicted that way turns into a span of holes."""
        spans = self.spans
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
        span is empty: a state page is reused as it is, a K/V page becomes a hole."""
        spans = self.spans
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
        """As :meth:`BlockPool.release`; a page no block is cached in becomes a hole (a
        state page: its span's pages)."""
        spans, hashes = self.spans, self._hash
        used, owner, widths = self.num_used_per_group, self._group, self.widths
        for page in self._drop_refs(pages):
            g = owner[page]
            used[g] -= 1
            self._num_free += widths[g]
            if widths[g] > 1:
                spans.release_state(page)
            else:
                spans.release_small(page)
            if hashes[page] is not None:
                self._free.push((page,), hashes)
            else:
                self._free_unhashed(page)

    def _free_unhashed(self, page: int) -> None:
        if self._is_state_page(page):
            self.spans.state_to_holes(page)
        else:
            self.spans.add_hole(page)

    def _check_free_pages(self) -> None:
        k, widths, owner = self.span, self.widths, self._group
        num_spans = self.num_blocks // k
        used, queued = [0] * num_spans, [0] * num_spans
        used[0] = 1  # the null page
        for page in range(1, self.num_blocks):
            is_queued = page in self._free
            assert not (is_queued and self._ref[page]), page
            if not (is_queued or self._ref[page]):
                continue
            width = widths[owner[page]]
            assert width == 1 or page % k == 0, ("a state page off its span", page)
            (queued if is_queued else used)[page // k] += width
            assert not is_queued or self._hash[page] is not None, ("a hole queued", page)
        self.spans.check_integrity(used, queued)
