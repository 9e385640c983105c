"""Which prefixes the prefix cache keeps: where requests end, and where they branch.

A cached block is worth keeping only while some prefix a future request can resume from
needs it in every group. Two kinds of prefix are worth that, and nothing else is kept:

- where a request ended (finished, preempted or aborted): its next turn, or its
  readmission, resumes exactly there. The request that resumes gives it up again, so the
  blocks its window dropped on the way go back to being worth nothing. A *nested*
  prefix (every group reads every block) loses nothing that way, so the request carries
  it instead and extends it by its own blocks when it ends: a long conversation costs
  its new blocks a turn, not its whole history;
- where a request branched off a prefix that others computed (a shared system prompt, a
  regenerated answer): proven to be shared, it is kept across hits.

Whatever a policy needs at a prefix's end is asked of the policy itself
(``live_block_spans``), so a user's policy is kept the same way as the built-in ones::

    prefix of 6 blocks, bs=4           blocks kept
    full attention                     0 1 2 3 4 5      nested: shrinks block by block
    sliding window W=9 (reads 8)       . . . . 4 5      a unit: goes all at once
    mamba-like (state after token 23)  . . . . . 5
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from hybridkv.memory.free_queue import KeptPrefix
from hybridkv.memory.hashing import BlockHash
from hybridkv.memory.pool import BlockPool
from hybridkv.memory.request_blocks import NOT_RESUMED, Kind, Resumed
from hybridkv.policies.base import Span


class Retention:
    """Decides what the pool keeps for future hits when requests end and resume.

    Args:
        pool: The pool whose free queue keeps the prefixes.
        kinds: Each distinct policy with the groups that use it.
        block_size: Tokens per block.
    """

    def __init__(
        self,
        pool: BlockPool,
        kinds: Sequence[Kind],
        block_size: int,
    ) -> None:
        self.pool = pool
        self._kinds = kinds
        self._num_groups = sum(len(groups) for _, groups in kinds)
        self.block_size = block_size

    def request_ended(
        self,
        hashes: Sequence[BlockHash],
        num_blocks: int,
        tables: Sequence[list[int]],
        *,
        tables_are_cached: bool,
        resumed: Resumed = NOT_RESUMED,
    ) -> KeptPrefix | None:
        """Keep the prefix a request ended with (its ``num_blocks`` filled blocks).

        Call it before the request's pages are released. ``tables_are_cached``: every
        filled block's page in ``tables`` is the one the cache map names (no block was
        computed twice); otherwise the pages are looked up. ``resumed``: what
        :meth:`request_resumed` returned for the request; a carried prefix is extended
        here when it can be, a pinned one released.
        """
        built = None
        if num_blocks:
            built = self._prefix(hashes, num_blocks, tables, tables_are_cached, is_branch=False)
        pinned = resumed.pinned
        if pinned is not None and pinned.is_carried and not pinned.is_branch:
            if built is not None and self._extend(pinned, built[0], built[1]):
                self.pool.release_kept(pinned)
                return pinned
            self.pool.stop_keeping(pinned, in_use=False)
        elif pinned is not None:
            self.pool.release_kept(pinned)
        if built is None:
            return None
        prefix, looked_up = built
        # The conversation's next turn is expected as far off as this one was.
        prefix.reuse_distance = resumed.reuse_distance
        # Pages taken from the request's tables are all in use until it is released.
        return self.pool.keep(prefix, in_use=not looked_up)

    def _extend(self, carried: KeptPrefix, prefix: KeptPrefix, looked_up: bool) -> bool:
        """Make ``carried`` the longer nested ``prefix`` that starts with it, if it is."""
        held = carried.held_pages
        new = len(prefix.pages) - len(held)
        if looked_up or not prefix.num_groups or new < 0 or prefix.pages[new:] != held:
            return False
        return self.pool.extend_kept(carried, prefix.hashes, prefix.pages[:new], prefix.num_blocks)

    def request_admitted(
        self, hashes: Sequence[BlockHash], num_blocks: int, tables: Sequence[Sequence[int]]
    ) -> Resumed:
        """A request was admitted with a hit of ``num_blocks`` blocks (maybe 0; ``tables``:
        the hit's pages) on the path ``hashes``: see :meth:`request_resumed`. A request
        that comes back to a prefix eviction gave up (a miss, or a shorter hit) still
        tells its conversation's reuse distance, which the prefix it ends with inherits.
        """
        resumed = NOT_RESUMED
        if num_blocks:
            resumed = self.request_resumed(hashes, num_blocks, tables)
        if not resumed.reuse_distance:
            distance = self.pool.recall_evicted(hashes)
            if distance:
                resumed = Resumed(resumed.pinned, distance)
        return resumed

    def request_resumed(
        self, hashes: Sequence[BlockHash], num_blocks: int, tables: Sequence[Sequence[int]]
    ) -> Resumed:
        """A request took a hit of ``num_blocks`` blocks (``tables``: the hit's pages).

        A request that ended there is continued: its prefix is no longer kept for itself;
        a nested one is carried instead (see :meth:`request_ended`), and a second request
        resuming it makes it a branch. Otherwise the hit is a branch point, kept, unless
        the path goes on in some group (the hit was cut short by a block another group
        lost, not shared up to here). A kept prefix the request resumes or branches at
        is pinned until the request ends.
        """
        kept = self.pool.kept_prefix(hashes[num_blocks - 1])
        if kept is not None:
            self.pool.resume(kept)
            if kept.is_carried:
                kept.is_branch = True  # a second request resumes it: shared
            if kept.is_branch:
                return Resumed(kept, 0)
            if kept.num_groups:
                kept.is_carried = True
            else:
                self.pool.stop_keeping(kept, in_use=True)
                return Resumed(None, kept.reuse_distance)
            return Resumed(kept, kept.reuse_distance)
        if num_blocks < len(hashes):
            following = hashes[num_blocks]
            if any(self.pool.lookup(following, g) is not None for g in range(self._num_groups)):
                return NOT_RESUMED
        built = self._prefix(hashes, num_blocks, tables, True, is_branch=True)
        if built is None:
            return NOT_RESUMED
        # The resuming request holds its pages, and pins it.
        return Resumed(self.pool.keep(built[0], in_use=True, pinned=True), 0)

    def _needs(self, num_blocks: int) -> list[tuple[Span, ...]]:
        """Per kind, the block spans that resuming after ``num_blocks`` blocks reads."""
        bs = self.block_size
        out = []
        for policy, _ in self._kinds:
            # Clipped to the prefix: the block the next token is written to is not read.
            needed = []
            for first, stop in policy.live_block_spans(num_blocks * bs, bs):
                if first < num_blocks:
                    needed.append((first, min(stop, num_blocks)))
            out.append(tuple(needed))
        return out

    def _prefix(
        self,
        hashes: Sequence[BlockHash],
        num_blocks: int,
        tables: Sequence[Sequence[int]],
        tables_are_cached: bool,
        *,
        is_branch: bool,
    ) -> tuple[KeptPrefix, bool] | None:
        """The prefix of ``num_blocks`` blocks, and whether its pages were looked up in the
        cache map rather than taken from ``tables``; None if some block it needs is gone."""
        needs = self._needs(num_blocks)
        # Every group reading every block: each shorter prefix resumes from a subset.
        every_block = ((0, num_blocks),)
        nested = True
        for spans in needs:
            nested = nested and spans == every_block
        num_groups = self._num_groups
        pages: list[int] = []
        if nested and num_groups == 1:
            pages = list(tables[0][num_blocks - 1 :: -1])  # last block first; a copy
        elif nested:
            # Evicted last block first, every group's page of a block together.
            pages = [0] * (num_blocks * num_groups)
            for group, table in enumerate(tables):
                pages[group::num_groups] = table[num_blocks - 1 :: -1]
        else:
            for (_, groups), spans in zip(self._kinds, needs, strict=True):
                for group in groups:
                    for first, stop in spans:
                        pages += tables[group][first:stop]
        looked_up = not tables_are_cached or 0 in pages  # rare: duplicates, failed steps
        if looked_up:
            found = self._cached_pages(hashes, num_blocks, needs, nested)
            if found is None:
                return None
            pages = found
        if not pages:
            return None  # nothing to resume from (a chunk start, say): nothing to keep
        prefix = KeptPrefix(
            hashes=hashes,
            pages=pages,
            num_blocks=num_blocks,
            num_groups=num_groups if nested else 0,
            is_branch=is_branch,
        )
        return prefix, looked_up

    def _cached_pages(
        self,
        hashes: Sequence[BlockHash],
        num_blocks: int,
        needs: list[tuple[Span, ...]],
        nested: bool,
    ) -> list[int] | None:
        """The same pages as ``_prefix`` builds, looked up in the cache map (slow path)."""
        lookup = self.pool.lookup
        wanted: list[tuple[int, int]] = []  # (block, group), in eviction order
        if nested:
            groups = range(self._num_groups)
            wanted = [(i, g) for i in range(num_blocks - 1, -1, -1) for g in groups]
        else:
            for (_, kind_groups), spans in zip(self._kinds, needs, strict=True):
                for g in kind_groups:
                    wanted += [(i, g) for first, stop in spans for i in range(first, stop)]
        pages = []
        for i, g in wanted:
            page = lookup(hashes[i], g)
            if page is None:
                return None
            pages.append(page)
        return pages

    def check_integrity(self, pinned: Iterable[KeptPrefix | None]) -> None:
        """Assert that each kept prefix holds exactly the cached pages its end needs, and
        is pinned once by each running request in ``pinned`` (what each resumed)."""
        pins = Counter(pinned)
        for prefix in self.pool.kept_prefixes():
            assert prefix.num_pins == pins[prefix], (prefix.num_pins, pins[prefix])
            held = set(prefix.held_pages)
            want = self._cached_pages(
                prefix.hashes,
                prefix.num_blocks,
                self._needs(prefix.num_blocks),
                prefix.num_groups > 0,
            )
            assert want is not None and set(want) == held, (prefix.num_blocks, want, held)
