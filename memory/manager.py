"""The KV cache manager: one block table per request and group, over one shared pool.

One manager serves an engine. Each KV group has a memory policy; the manager asks the
policies what each request needs, and commits every group's change or none::

    request r, three groups, block_size 4, 10 tokens computed, a step of 1 token
    group 0  full        [ p3 | p7 | p2 ]        blocks 0..2 live
    group 1  window W=5  [ 0  | p9 | p4 ]        block 0 dead: released, null in the table
    group 2  window W=5  [ 0  | p5 | p8 ]

Caching follows the tokens: when a block of a request fills, its chained hash (shared by
all groups) makes each group's page findable, and the page stays findable after it is
released, until the pool reuses it. ``lookup`` finds the longest prefix that every group
can resume from. Which released pages the pool reuses last, because a prefix a future
request can resume from needs them, is decided in ``hybridkv.memory.retention``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridkv.memory.errors import LayoutError
from hybridkv.memory.hashing import BlockHash, BlockHasher
from hybridkv.memory.interface import (
    NO_NEW_BLOCKS,
    KVRequest,
    KVUsage,
    PrefixHit,
    StaleHitError,
)
from hybridkv.memory.layout import PoolSpec
from hybridkv.memory.pool import NULL_BLOCK
from hybridkv.memory.prefix_lookup import check_hit, find_prefix_hit
from hybridkv.memory.request_blocks import Kind, RequestBlocks
from hybridkv.memory.retention import Retention
from hybridkv.memory.span_pool import make_pool
from hybridkv.memory.step_pages import StepPages
from hybridkv.policies.base import MemoryPolicy, cdiv

__all__ = ["NO_NEW_BLOCKS", "KVCacheManager", "KVRequest", "KVUsage", "PrefixHit", "StaleHitError"]


class KVCacheManager:
    """Allocates, caches and releases pages for every KV group at once.

    Args:
        policies: The memory policy of each group, in group order.
        num_blocks: Pages in the pool, the null page 0 included.
        block_size: Tokens per block, the same for every group.
        enable_prefix_caching: Cache full blocks and serve prefix hits.
        hash_name: Block hash function (see ``hybridkv.memory.hashing``).
        state_span: Page ids one state page takes (``hybridkv.memory.spans``): the state
            groups' pages are that many of the K/V groups' pages, carved from the same
            pool; 1 gives every group one page size.
    """

    def __init__(
        self,
        policies: Sequence[MemoryPolicy],
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        hash_name: str = "sha256",
        state_span: int = 1,
    ) -> None:
        if not policies:
            raise LayoutError("a KV cache manager needs at least one group")
        if block_size < 1:
            raise LayoutError(f"block_size must be >= 1, got {block_size}")
        self.policies = tuple(policies)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        widths = [state_span if p.keeps_state else 1 for p in self.policies]
        self.pool = make_pool(num_blocks, len(self.policies), widths)
        # Its clock counts demand, tokens given slots hits included (eviction_order.py
        # says why); its horizon, about a pool's worth of tokens.
        self._order = self.pool.eviction_order
        self._order.horizon = max(1, num_blocks * block_size // len(self.policies))
        self._hasher = BlockHasher(block_size, hash_name)
        #: The prefix-cache hash (``memory/hashing.py``), as KV events' consumers need it.
        self.hash_name = hash_name
        # Groups with equal policies share the block arithmetic: a "kind" per policy.
        kinds: dict[MemoryPolicy, list[int]] = {}
        for group, policy in enumerate(self.policies):
            kinds.setdefault(policy, []).append(group)
        self._kinds: list[Kind] = [(policy, tuple(groups)) for policy, groups in kinds.items()]
        self._groups = tuple(range(len(self.policies)))
        self._retention = Retention(self.pool, self._kinds, block_size)
        self._requests: dict[str, RequestBlocks] = {}
        self._pages = StepPages(self.pool, self._kinds, block_size)
        self._hit_tokens = 0
        self._query_tokens = 0

    @classmethod
    def for_pool(cls, pool: PoolSpec, **options: Any) -> KVCacheManager:
        """A manager of ``pool`` (an executor's or a plan's): its policies, pages, block
        size and state span; ``options`` as the constructor's keywords."""
        return cls(
            pool.policies, pool.num_blocks, pool.block_size, state_span=pool.state_span, **options
        )

    # -- queries -----------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        """KV groups."""
        return len(self.policies)

    @property
    def num_free_blocks(self) -> int:
        """Pages an allocation may take now."""
        return self.pool.num_free

    @property
    def num_usable_blocks(self) -> int:
        """Pages of the pool that requests can hold (all but the null page)."""
        return self.pool.num_blocks - 1

    def block_tables(self, request_id: str) -> Sequence[list[int]]:
        """Per group, the request's page ids (read-only; valid until its next change)."""
        return self._requests[request_id].tables

    def block_hashes(self, request_id: str) -> Sequence[BlockHash]:
        """The request's chained block hashes so far (read-only), one per cached block."""
        return self._requests[request_id].hashes

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Most page ids a request of ``num_tokens`` holds at once, computed a token at a
        time (a state page counts its span)."""
        widths = self.pool.widths
        return sum(
            p.max_live_blocks(num_tokens, self.block_size) * sum(widths[g] for g in groups)
            for p, groups in self._kinds
        )

    def usage(self) -> KVUsage:
        """Pool usage per group and the prefix-cache counters."""
        return KVUsage(
            num_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free,
            blocks_used_per_group=tuple(self.pool.num_used_per_group),
            state_pages_used=sum(
                n
                for n, p in zip(self.pool.num_used_per_group, self.policies, strict=True)
                if p.keeps_state
            ),
            num_free_state_pages=self.pool.num_free_spans,
            prefix_hit_tokens=self._hit_tokens,
            prefix_query_tokens=self._query_tokens,
        )

    # -- prefix cache ------------------------------------------------------------------

    def lookup(self, request: KVRequest) -> PrefixHit:
        """The longest cached prefix of ``request`` that every group can resume from
        (see :func:`~hybridkv.memory.prefix_lookup.find_prefix_hit`)."""
        if not self.enable_prefix_caching:
            return PrefixHit(0, (), [])
        return find_prefix_hit(self.pool, self._kinds, self._hasher, request)

    # -- allocation --------------------------------------------------------------------

    def allocate(
        self, request: KVRequest, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> tuple[list[int], ...] | None:
        """Reserve slots for the next ``num_new_tokens`` positions in every group.

        The first call for a request (new, or back after :meth:`free`) resumes from
        ``hit`` (from :meth:`lookup` in the same step) or from scratch; each later call
        continues where the previous one ended, which is taken as computed.

        Returns the new pages per group (empty when no page was needed), or None when the
        pool cannot supply every group: then nothing changed at all.
        """
        state = self._requests.get(request.request_id)
        if state is None:
            return self._admit(request, num_new_tokens, hit)
        end = state.num_tokens + num_new_tokens
        if end < state.capacity and state.num_tokens < state.min_release_at:
            # Within the current blocks and no block can die yet: nothing to do.
            state.num_tokens = end
            state.cache_mark = state.num_cached_blocks
            self._order.clock += num_new_tokens
            return NO_NEW_BLOCKS
        return self._extend(request, state, end)

    def reserve_lookahead(self, request: KVRequest, num_tokens: int) -> bool:
        """Slots for ``num_tokens`` positions past the request's latest allocation, for the
        proposed tokens a verification step runs (speculative decoding): never computed
        until :meth:`accept` keeps them, never cached, releasing nothing; False when the
        pool cannot supply every group (nothing changed). See ``StepPages.reserve``."""
        return self._pages.reserve(self._requests[request.request_id], num_tokens)

    def accept(self, request: KVRequest, num_tokens: int) -> None:
        """A verification step ran: its first ``num_tokens`` lookahead positions hold
        tokens it kept (in ``request.all_token_ids`` by now), computed and cached as blocks
        fill; the pages of blocks past them go back uncached (rejected tokens only)."""
        state = self._requests[request.request_id]
        state.num_tokens += num_tokens
        self._order.clock += num_tokens
        state.drop_blocks_from(cdiv(state.num_tokens, self.block_size), self.pool, self.block_size)
        self._cache_full_blocks(request, state)

    def spare_chunk(
        self,
        request: KVRequest,
        num_new_tokens: int,
        hit: PrefixHit | None = None,
        *,
        at_least: int,
    ) -> int:
        """How many of the next ``num_new_tokens`` positions to allocate so that no kept
        prefix gives up a page for them: ``num_new_tokens``, halved while a kept prefix
        would, but not below ``at_least`` (``hit``: as for a first :meth:`allocate`);
        ``StepPages.spare_chunk`` says where and why.
        """
        state = self._requests.get(request.request_id)
        return self._pages.spare_chunk(state, num_new_tokens, hit, at_least)

    def admit_loading(
        self, request: KVRequest, hit: PrefixHit, num_tokens: int
    ) -> tuple[tuple[tuple[int, int], ...], ...] | None:
        """Admit a request that resumes at ``num_tokens`` (a block multiple beyond ``hit``)
        whose other blocks an offload tier supplies (``hybridkv.memory.offload``).

        Every group holds the hit's pages it still needs at ``num_tokens`` and a fresh page
        for each other block its policy needs there. The fresh pages are not cached until
        the request's next allocation (taken as the load having finished): a load that
        fails is freed with ``free(..., computed=False)``. Returns, per group, the (block,
        page) pairs to fill, or None when the pool cannot supply them: nothing changed.
        """
        bs, pool = self.block_size, self.pool
        num_blocks = num_tokens // bs
        hit_tables = hit.block_tables if hit.num_tokens else ((),) * self.num_groups
        live: list[set[int]] = []
        fresh = [0, 0]  # small pages, state pages
        for group, (policy, hit_table) in enumerate(zip(self.policies, hit_tables, strict=True)):
            spans = policy.live_block_spans(num_tokens, bs)
            blocks = {i for first, stop in spans for i in range(first, min(stop, num_blocks))}
            live.append(blocks)
            num = sum(1 for i in blocks if i >= len(hit_table) or not hit_table[i])
            fresh[pool.widths[group] > 1] += num
        if hit.num_tokens:
            check_hit(self.pool, hit)
        if not pool.fits(*fresh, take=hit.block_tables if hit.num_tokens else ()):
            return None
        self._admit(request, 0, hit)
        self._order.clock += num_tokens - hit.num_tokens
        state = self._requests[request.request_id]
        placed = state.place_live(live, num_blocks, pool)
        state.num_tokens = state.capacity = num_tokens
        state.release_at = [num_tokens] * len(self._kinds)
        state.advance_release(state.release_scan(self._kinds, num_tokens, bs, find_dead=False)[1])
        return placed

    def _extend(
        self, request: KVRequest, state: RequestBlocks, end: int
    ) -> tuple[list[int], ...] | None:
        bs, pool = self.block_size, self.pool
        n = state.num_tokens
        dead: list[tuple[int, int]] = []
        scanned: list[tuple[int, int, int]] = []
        if n >= state.min_release_at:
            dead, scanned = state.release_scan(self._kinds, n, bs)
        num_new = cdiv(end, bs) - len(state.tables[0])
        tables = state.tables
        wanted = None
        if num_new > 0:
            wanted = self._pages.wanted(len(tables[0]), n, end, state.checkpoints)
            released = [(g, tables[g][i]) for g, i in dead]
            if not pool.fits(*self._pages.need(wanted, num_new), release=released):
                return None
        self._order.clock += end - n
        # Commit: release first (tail first), then take fresh pages.
        if n >= state.min_release_at:
            if dead:
                pool.release([tables[g][i] for g, i in reversed(dead)])
                for group, i in dead:
                    tables[group][i] = NULL_BLOCK
            state.advance_release(scanned)
        new_pages: tuple[list[int], ...] = NO_NEW_BLOCKS
        if num_new > 0:
            new_pages = self._pages.take(state.tables, wanted, num_new)
            state.capacity = len(state.tables[0]) * bs
        state.num_tokens = end
        self._cache_full_blocks(request, state)
        return new_pages

    def _admit(
        self, request: KVRequest, num_new_tokens: int, hit: PrefixHit | None
    ) -> tuple[list[int], ...] | None:
        bs, pool = self.block_size, self.pool
        num_hit = hit.num_tokens if hit is not None else 0
        hit_blocks = num_hit // bs
        end = num_hit + num_new_tokens
        num_new = cdiv(end, bs) - hit_blocks
        hashes = hit.hashes if hit is not None else []
        checkpoints = hit.checkpoints if hit is not None else ()
        wanted = self._pages.wanted(hit_blocks, num_hit, end, checkpoints)
        taken: tuple[tuple[int, ...], ...] = ()
        if hit is not None and num_hit:
            check_hit(self.pool, hit)
            taken = hit.block_tables
        if not pool.fits(*self._pages.need(wanted, num_new), take=taken):
            return None
        # Commit: claim every group's cached pages before any group takes a fresh one.
        if hit is not None and num_hit:
            tables = [list(table) for table in hit.block_tables]
            pool.take_tables(tables)
        else:
            tables = [[] for _ in self._groups]
        new_pages = self._pages.take(tables, wanted, num_new)
        num_kinds = len(self._kinds)
        state = RequestBlocks(
            tables=tables,
            hashes=hashes,
            root=self._hasher.root(request.extra_keys),
            num_tokens=end,
            num_cached_blocks=hit_blocks,
            cache_mark=hit_blocks,
            capacity=len(tables[0]) * bs,
            release_at=[num_hit] * num_kinds,
            scan_from=[0] * num_kinds,
            uncache_mark=pool.num_uncached,
            checkpoints=checkpoints,
        )
        # A hit's tables hold only blocks live at its end: nothing to find dead.
        state.advance_release(state.release_scan(self._kinds, num_hit, bs, find_dead=False)[1])
        self._requests[request.request_id] = state
        self._cache_full_blocks(request, state)
        if hit is not None and hashes:
            state.resumed = self._retention.request_admitted(hashes, hit_blocks, hit.block_tables)
        self._order.clock += end  # after the resume measured the demand since its last use
        if self.enable_prefix_caching:
            self._hit_tokens += num_hit
            self._query_tokens += len(request.all_token_ids)
        return new_pages

    def _cache_full_blocks(self, request: KVRequest, state: RequestBlocks) -> None:
        state.cache_mark = state.num_cached_blocks
        num_full = state.num_tokens // self.block_size
        if not self.enable_prefix_caching or num_full <= state.num_cached_blocks:
            return
        if len(state.hashes) < num_full:
            self._hasher.extend(state.hashes, state.root, request.all_token_ids, state.num_tokens)
        state.num_uncached += self.pool.cache_blocks(
            state.tables, state.hashes, state.num_cached_blocks, num_full, request.all_token_ids
        )
        state.num_cached_blocks = num_full

    # -- release -----------------------------------------------------------------------

    def free(self, request_id: str, *, computed: bool = True) -> None:
        """Return all of a request's pages to the pool, tail first (no-op if unknown).

        The prefix of its filled blocks is kept for a future hit (its next turn, or its
        readmission after a preemption); see ``hybridkv.memory.retention``.

        Args:
            request_id: The request.
            computed: False when the step of the latest allocation never ran: blocks
                cached by that allocation hold no K/V and are uncached first.
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        num_filled = state.num_cached_blocks
        if not computed:
            num_filled = state.cache_mark
            for table in state.tables:
                for i in range(state.cache_mark, state.num_cached_blocks):
                    if table[i]:
                        self.pool.uncache(table[i])
        if self.enable_prefix_caching and (num_filled or state.resumed.pinned):
            self._retention.request_ended(
                state.hashes,
                num_filled,
                state.tables,
                tables_are_cached=not state.num_uncached
                and state.uncache_mark == self.pool.num_uncached,
                resumed=state.resumed,
            )
        for group, table in enumerate(state.tables):
            self.pool.release([p for p in reversed(table) if p], group)

    def check_integrity(self) -> None:
        """Assert that reference counts equal table references and the pool is exact."""
        self.pool.check_integrity()
        refs = [0] * self.pool.num_blocks
        for state in self._requests.values():
            for table in state.tables:
                for page in table:
                    refs[page] += 1
        refs[NULL_BLOCK] = 0
        for page in range(1, self.pool.num_blocks):
            assert refs[page] == self.pool.ref_count(page), page
        self._retention.check_integrity([s.resumed.pinned for s in self._requests.values()])
