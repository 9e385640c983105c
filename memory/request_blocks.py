"""A request's blocks in every group, and when its policies let them go.

The KV cache manager keeps one :class:`RequestBlocks` per running request: its block
table per group, its chained block hashes, how far it is computed and cached, and the
release schedule of each policy kind (distinct policy, with the groups that use it).

Blocks are released where a block starts, not at every token::

    tokens  0 1 2 3 | 4 5 6 7 | 8 9 . .      bs=4, window W=6, 10 tokens computed
    at 10   reads [5, 10): block 0 is dead
    at 8    reads [3, 8):  block 0 still read by the prefix of the 2 blocks filled
    held    [ b3 ] [ b7 ] [ b2 ]             block 0 goes when position 12 starts block 3

so the prefix of the blocks a request has filled can always be resumed from what it holds
(the prefix cache keeps that prefix when the request ends). A policy holds the most blocks
at a block start anyway, so this costs no pages at the peak: a window keeps at most one
block per group a little longer, a mamba-like layer its last block-boundary state.
"""

from __future__ import annotations

import attrs

from hybridkv.memory.free_queue import KeptPrefix
from hybridkv.memory.hashing import BlockHash
from hybridkv.memory.pool import NULL_BLOCK, BlockPool
from hybridkv.policies.base import MemoryPolicy, cdiv

#: A distinct policy and the groups that use it (they share the block arithmetic).
Kind = tuple[MemoryPolicy, tuple[int, ...]]


@attrs.frozen
class Resumed:
    """What a request resumed, for :meth:`Retention.request_ended`.

    Attributes:
        pinned: The kept prefix it continues or branched at, pinned while it runs.
        reuse_distance: Its conversation's last measured reuse distance (0: unknown),
            which the prefix it ends with inherits.
    """

    pinned: KeptPrefix | None
    reuse_distance: int


#: A request that took no hit.
NOT_RESUMED = Resumed(None, 0)


@attrs.define(slots=True)
class RequestBlocks:
    """One request's pages and progress (the manager's private record)."""

    tables: list[list[int]]
    hashes: list[BlockHash]
    root: BlockHash
    num_tokens: int  # positions with slots; computed once their step has run
    num_cached_blocks: int  # blocks [0, n) have been offered to the cache
    cache_mark: int  # num_cached_blocks before the latest allocation
    capacity: int  # tokens the tables cover
    release_at: list[int]  # per policy kind: no release scan below this token count
    scan_from: list[int]  # per policy kind: blocks below are null or kept for good
    min_release_at: int = 0
    num_uncached: int = 0  # filled blocks whose page is not the cached one (a duplicate)
    uncache_mark: int = 0  # pool.num_uncached at admission: a held page may have lost it
    resumed: Resumed = NOT_RESUMED  # the kept prefix it resumed (pinned), for its end
    checkpoints: tuple[int, ...] = ()  # token counts where its state groups keep a state

    def release_scan(
        self, kinds: list[Kind], n: int, block_size: int, *, find_dead: bool = True
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
        """Blocks held but dead where ``n``'s block starts, and what the scan advances.

        Returns the dead (group, block) pairs in table order, and per kind scanned (kind,
        blocks below which all are null or kept for good, next token count worth a scan),
        for :meth:`advance_release` once the caller commits. Changes nothing.
        """
        bs, tables = block_size, self.tables
        start = n - n % bs
        dead: list[tuple[int, int]] = []
        scanned: list[tuple[int, int, int]] = []
        for k, (policy, groups) in enumerate(kinds):
            if n < self.release_at[k]:
                continue
            spans = policy.live_block_spans(start, bs)
            lo = self.scan_from[k]
            for first, stop in spans:
                if not find_dead:
                    break
                for i in range(lo, first):
                    for g in groups:
                        if tables[g][i]:
                            dead.append((g, i))
                lo = max(lo, stop)
            scan_from = max(self.scan_from[k], spans[-1][0] if spans else 0)
            # Releases happen at block starts: round the next death up to one.
            scanned.append((k, scan_from, cdiv(policy.next_release(start, bs), bs) * bs))
        return dead, scanned

    def drop_blocks_from(self, first: int, pool: BlockPool, block_size: int) -> None:
        """Release the pages of blocks ``first`` on in every group, tail first (uncached
        pages a verification step reserved past the tokens it kept)."""
        if len(self.tables[0]) <= first:
            return
        for group, table in enumerate(self.tables):
            pool.release([p for p in reversed(table[first:]) if p], group)
            del table[first:]
        self.capacity = first * block_size

    def place_live(
        self, live: list[set[int]], num_blocks: int, pool: BlockPool
    ) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Make the tables hold exactly the ``live`` blocks of each group over
        ``num_blocks`` blocks: release the others, take a fresh page for each live block
        without one. Returns, per group, the (block, page) pairs taken (an offload tier
        fills them: ``KVCacheManager.admit_loading``)."""
        placed: list[tuple[tuple[int, int], ...]] = []
        for group, (table, blocks) in enumerate(zip(self.tables, live, strict=True)):
            dead = [i for i, page in enumerate(table) if page and i not in blocks]
            pool.release([table[i] for i in reversed(dead)], group)
            for i in dead:
                table[i] = NULL_BLOCK
            table.extend([NULL_BLOCK] * (num_blocks - len(table)))
            missing = sorted(i for i in blocks if not table[i])
            pages = pool.allocate(len(missing), group)
            for i, page in zip(missing, pages, strict=True):
                table[i] = page
            placed.append(tuple(zip(missing, pages, strict=True)))
        return tuple(placed)

    def advance_release(self, scanned: list[tuple[int, int, int]]) -> None:
        """Record what :meth:`release_scan` found (its dead blocks are released)."""
        for k, scan_from, release_at in scanned:
            self.scan_from[k] = scan_from
            self.release_at[k] = release_at
        self.min_release_at = min(self.release_at)
