"""Which fresh pages a step over ``[start, end)`` takes in each group, and how many.

Most steps take a page for each new block in every group. A policy that keeps its state
in pages (``MemoryPolicy.page_blocks``) takes one only where the step leaves a state, and
its groups' tables hold the null page elsewhere::

    step over tokens [16, 48), bs=16, first new block 1
    full attention        blocks 1 2   -> 2 fresh pages
    mamba-like            block    2   -> 1 fresh page (the state after token 47)

The KV cache manager counts with these before it commits (check, then mutate), and the
planner asks how many free pages nobody keeps a chunk would take
(``KVCacheManager.spare_chunk``).
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.memory.interface import PrefixHit
from hybridkv.memory.pool import NULL_BLOCK, BlockPool
from hybridkv.memory.request_blocks import Kind, RequestBlocks
from hybridkv.policies.base import MemoryPolicy, cdiv


class StepPages:
    """The page arithmetic of one step, over every group of a pool.

    Args:
        pool: The pool pages come from.
        kinds: Each distinct policy with the groups that use it.
        block_size: Tokens per block.
    """

    def __init__(self, pool: BlockPool, kinds: Sequence[Kind], block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._kinds = list(kinds)
        self.num_groups = sum(len(groups) for _, groups in kinds)
        self._groups = tuple(range(self.num_groups))
        widths = pool.widths
        self._num_small = sum(1 for w in widths if w == 1)
        self._num_states = self.num_groups - self._num_small
        self._span = pool.span
        #: Page ids one block of every group takes.
        self.ids_per_block = sum(widths)
        #: Some K/V group stops reading blocks as a request advances (a window).
        self.releases_pages = any(_releases_pages(policy, block_size) for policy, _ in kinds)

    def wanted(
        self, first: int, start: int, end: int, checkpoints: Sequence[int] = ()
    ) -> list[list[int]] | None:
        """Per group, the blocks from ``first`` on that take a fresh page in a step over
        ``[start, end)`` (``checkpoints``: token counts where state groups keep a state,
        see ``MemoryPolicy.page_blocks``); None when every group takes one for each block
        (K/V groups only, or a decode: the common case)."""
        bs = self.block_size
        by_kind = [p.page_blocks(start, end, bs, checkpoints) for p, _ in self._kinds]
        if all(blocks is None for blocks in by_kind):
            return None
        every = list(range(first, cdiv(end, self.block_size)))
        wanted: list[list[int]] = [every] * self.num_groups
        for blocks, (_, groups) in zip(by_kind, self._kinds, strict=True):
            if blocks is not None:
                for group in groups:
                    wanted[group] = [i for i in blocks if i >= first]
        return None if all(len(w) == len(every) for w in wanted) else wanted

    def reserve(self, state: RequestBlocks, num_tokens: int) -> bool:
        """Extend a request's tables for ``num_tokens`` lookahead positions past
        ``state.num_tokens`` (speculative decoding), in every group or none::

            tokens  ... 9 | 10 11 12 13 | 14 15      bs=4, allocated to 11, 4 ahead
            slots           alloc ahead | ahead      block 3 is taken for the lookahead

        Nothing is released or cached; state groups take a page in every block the
        lookahead reaches, so that a state can be kept wherever verification stops.
        False when the pool cannot supply every group: nothing changed."""
        bs, n, tables = self.block_size, state.num_tokens, state.tables
        end = n + num_tokens
        num_new = cdiv(end, bs) - len(tables[0])
        if num_new <= 0:
            return True
        boundaries = tuple(range((n // bs + 1) * bs, end + 1, bs))
        wanted = self.wanted(len(tables[0]), n, end, (*state.checkpoints, *boundaries))
        if not self.pool.fits(*self.need(wanted, num_new)):
            return False
        self.take(tables, wanted, num_new)
        state.capacity = len(tables[0]) * bs
        return True

    def need(self, wanted: list[list[int]] | None, num_new: int) -> tuple[int, int]:
        """Fresh small pages and state pages a step takes, over every group (``num_new``
        blocks per table); a page one id wide counts as small (so every page does where
        state pages are one page id)."""
        if wanted is None:
            return num_new * self._num_small, num_new * self._num_states
        widths = self.pool.widths
        small = sum(len(w) for w, width in zip(wanted, widths, strict=True) if width == 1)
        return small, sum(map(len, wanted)) - small

    def count(self, wanted: list[list[int]] | None, num_new: int) -> int:
        """Page ids a step takes, over every group (``num_new`` blocks per table)."""
        small, states = self.need(wanted, num_new)
        return small + states * self._span

    def take(
        self, tables: list[list[int]], wanted: list[list[int]] | None, num_new: int
    ) -> tuple[list[int], ...]:
        """Extend every table by ``num_new`` blocks: a fresh page where ``wanted`` (every
        block when None), the null block elsewhere. Returns the pages, per group."""
        if wanted is None:
            new_pages = self.pool.allocate_groups(num_new, self._groups)
            for table, pages in zip(tables, new_pages, strict=True):
                table.extend(pages)
            return new_pages
        out: list[list[int]] = [[] for _ in tables]
        widths = self.pool.widths
        # State pages first: a small page never breaks a span this step counted on.
        for group in sorted(self._groups, key=lambda g: widths[g] == 1):
            table, blocks = tables[group], wanted[group]
            table.extend([NULL_BLOCK] * num_new)
            pages = self.pool.allocate(len(blocks), group) if blocks else []
            for i, page in zip(blocks, pages, strict=True):
                table[i] = page
            out[group] = pages
        return tuple(out)

    def spare_chunk(
        self,
        state: RequestBlocks | None,
        num_new_tokens: int,
        hit: PrefixHit | None,
        at_least: int,
    ) -> int:
        """``num_new_tokens``, halved while the step would take a page a kept prefix holds,
        not below ``at_least`` (``KVCacheManager.spare_chunk``).

        Only where some K/V group stops reading blocks as a request advances (a window, a
        user's policy that drops blocks): a prefill chunk holds more pages there during
        its step than after it, and a resumable prefix of such a group is whole or lost,
        so a long chunk's extra pages can cost a waiting request its whole hit while a
        short one fits in pages nobody keeps. Where every K/V group keeps every block, a
        shorter chunk would only delay the same eviction (a state group takes a page only
        where a step leaves a state, so it adds next to nothing): ``num_new_tokens`` is
        returned."""
        if num_new_tokens <= at_least or not self.releases_pages:
            return num_new_tokens
        pool = self.pool
        spare, spare_spans = pool.reusable(hit.block_tables if hit is not None else ())
        # Fresh page ids at most, and the hit's own pages, which may be unkept.
        most = (num_new_tokens // self.block_size + 2) * self.ids_per_block
        if hit is not None:
            most += pool.page_ids_in(hit.block_tables)
        if spare >= most and spare_spans >= most:
            return num_new_tokens  # the common case: pages nobody keeps are plenty

        def gives_up(num: int) -> bool:
            ids, states = self.num_taken(state, num, hit)
            return ids > spare or states > spare_spans

        while num_new_tokens > at_least and gives_up(num_new_tokens):
            num_new_tokens = max(at_least, num_new_tokens // 2)
        return num_new_tokens

    def num_taken(
        self, state: RequestBlocks | None, num_new_tokens: int, hit: PrefixHit | None
    ) -> tuple[int, int]:
        """Free page ids nobody keeps that a step of ``num_new_tokens`` would take, less
        those it releases, and the fresh state pages among them (0 where state pages are
        one page id): for a running request's ``state``, or a newcomer resuming ``hit``."""
        bs, pool = self.block_size, self.pool
        taken = 0
        checkpoints: tuple[int, ...] = ()
        if state is None:
            start = hit.num_tokens if hit is not None else 0
            first = start // bs
            if hit is not None:
                checkpoints = hit.checkpoints
                if start:
                    taken = pool.num_reusable_in(hit.block_tables)
        else:
            start, first, checkpoints = state.num_tokens, len(state.tables[0]), state.checkpoints
            if start >= state.min_release_at:
                tables = state.tables
                for g, i in state.release_scan(self._kinds, start, bs)[0]:
                    page = tables[g][i]
                    if pool.ref_count(page) == 1 and not pool.is_kept(page):
                        taken -= pool.widths[g]
        end = start + num_new_tokens
        num_new = cdiv(end, bs) - first
        states = 0
        if num_new > 0:
            small, states = self.need(self.wanted(first, start, end, checkpoints), num_new)
            taken += small + states * self._span
        return taken, states


def _releases_pages(policy: MemoryPolicy, block_size: int) -> bool:
    """Whether ``policy`` keeps K/V and stops reading some block of a long request."""
    if policy.keeps_state:
        return False
    num_blocks = 1 << 16
    spans = policy.live_block_spans(num_blocks * block_size, block_size)
    return spans[0][0] > 0 or len(spans) > 1
