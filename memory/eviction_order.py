"""Which kept prefix gives up its pages next: the one whose next resume is farthest off.

The pool keeps prefixes a future request can resume from (``hybridkv.memory.retention``
chooses them, :class:`~hybridkv.memory.free_queue.FreeQueue` holds their pages). When
pages run out, one of them must give up pages. The best choice is the prefix needed
farthest in the future (Belady); this module predicts that from what it saw, on a clock
of demand: the tokens requests were given slots for, resumed ones included (the KV cache
manager advances it)::

    predicted resume = last use + reuse distance
    last use         when the last request that read it ended (or when it was kept)
    reuse distance   measured when a request resumes it (now - last use), or comes back
                     to it after eviction gave it up (its key is remembered); the prefix
                     a request ends with inherits the distance of the one it continued;
                     one never resumed is expected no sooner than any measured reuse,
                     nor than a pool's worth of tokens

Why demand and not the pages allocations took: pages taken depend on what the cache
held. A miss recomputes its whole prefix and takes many times the pages of a hit, so on
a clock of pages, sessions of one loop measured distances that differed by the misses
that fell into their gaps, the order among them followed that luck, and the wrong ones
missed (``benchmarks/allocator/multisession.py``; docs/benchmarks.md has the measurement). Demand
counts the same tokens whether the requests in between hit or missed, so a distance
measures the loop, not the cache's past choices.

Least recently used is what this gives with no history at all reversed: a prefix that was
never resumed gives way newest first. Sessions that come back in a loop larger than the
pool (chats served in turn) are least recently used's worst case, which evicts exactly
the prefix needed next, so every miss recomputes a whole prefix that evicts the next one.
Farthest-first gives up the newest prefixes of such a loop instead and keeps a stable part
of it resumable; among prefixes whose reuse was measured, the one just used with the
longest distance goes first.

Two rules keep it safe outside loops:

- a prefix idle for twice the longest reuse distance measured so far is stale (its
  conversation is over): the least recently used prefix goes first when stale, so
  abandoned prefixes do not stay behind the ones still awaited (LIRS demotes the same way:
  only a reuse seen shorter than an entry's idle time displaces it). Reuse of evicted
  prefixes counts (ARC's ghost entries do the same), so a pool that has evicted every
  prefix that came back still learns how far apart reuse is;
- a prefix that a running request resumed is pinned (its pages are in use: giving it up
  frees nothing now) and gives up pages only when no other kept prefix is left.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import attrs

from hybridkv.memory.hashing import BlockHash


@attrs.define(slots=True, eq=False)
class KeptPrefix:
    """A prefix of ``num_blocks`` blocks that a future request can resume from.

    Attributes:
        hashes: The path's chained block hashes (at least ``num_blocks`` of them).
        pages: The pages it needs, all groups; a nested prefix lists them last block
            first, every group's page of a block together.
        num_blocks: Blocks of the prefix now (a nested prefix shrinks as it is evicted).
        num_groups: For a nested prefix, pages per block (the groups); 0 for a unit.
        is_branch: Requests branched off here (kept across hits), rather than a request
            ended here (given up by the request that continues it).
        is_carried: A running request continues it and will extend it when it ends.
        reuse_distance: Tokens requests were given slots for between its last use and
            its resume, as last measured in its conversation; 0 while never measured.
    """

    hashes: Sequence[BlockHash]
    pages: list[int]
    num_blocks: int
    num_groups: int
    is_branch: bool
    is_carried: bool = False
    reuse_distance: int = 0
    first_num_blocks: int = attrs.field(init=False)
    cursor: int = 0  # pages[:cursor] are no longer held
    last_use: int = 0  # the order's clock when a request last read it (or it was kept)
    num_pins: int = 0  # running requests that resumed it
    stamp: int = 0  # its latest entry in the order's heap

    def __attrs_post_init__(self) -> None:
        self.first_num_blocks = self.num_blocks

    @property
    def key(self) -> BlockHash:
        """The chained hash of its last block: equal keys, equal prefixes."""
        return self.hashes[self.num_blocks - 1]

    @property
    def held_pages(self) -> list[int]:
        """The pages it still holds."""
        return self.pages[self.cursor :]


class EvictionOrder:
    """The kept prefixes, in the order they give up pages.

    Args:
        horizon: The least reuse distance assumed for a prefix never resumed, on the
            clock (a pool's worth of tokens); whoever advances the clock may set it.
        max_ghosts: How many keys of evicted prefixes are remembered (``horizon``).

    Every method is O(log prefixes), amortized.
    """

    def __init__(self, horizon: int, max_ghosts: int | None = None) -> None:
        self.clock = 0  # tokens requests were given slots for so far (hits included)
        self.horizon = horizon
        self._max_ghosts = horizon if max_ghosts is None else max_ghosts
        self._longest = 0  # the longest reuse distance measured so far
        self._idle: OrderedDict[KeptPrefix, None] = OrderedDict()  # least recently used first
        self._pinned: dict[KeptPrefix, None] = {}
        # (-predicted resume, -stamp, prefix): the first entry goes first (ties: the newer)
        self._heap: list[tuple[int, int, KeptPrefix]] = []
        self._stamps = 0
        # The keys of prefixes eviction gave up wholly, with their last use (oldest first).
        self._ghosts: OrderedDict[BlockHash, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._idle) + len(self._pinned)

    def __contains__(self, prefix: KeptPrefix) -> bool:
        return prefix in self._idle or prefix in self._pinned

    def __iter__(self) -> Iterator[KeptPrefix]:
        """Every prefix kept now: the pinned ones, then the others least recently used first."""
        yield from self._pinned
        yield from self._idle

    def predicted_resume(self, prefix: KeptPrefix) -> int:
        """When a request is expected to resume ``prefix``, on the clock."""
        # One never resumed is expected no sooner than any measured reuse, nor than a pool.
        distance = prefix.reuse_distance or max(self.horizon, self._longest)
        return prefix.last_use + distance

    def add(self, prefix: KeptPrefix, *, pinned: bool = False) -> None:
        """Order a newly kept ``prefix``, used now; ``pinned``: by the running request
        that computed it."""
        prefix.last_use = self.clock
        if self._ghosts:
            self._ghosts.pop(prefix.key, None)
        if pinned:
            prefix.num_pins += 1
            self._pinned[prefix] = None
        else:
            self._idle[prefix] = None
            self._push(prefix)

    def used(self, prefix: KeptPrefix) -> None:
        """A request computed ``prefix`` again (an equal one was kept): used now."""
        prefix.last_use = self.clock
        if prefix in self._idle:
            self._idle.move_to_end(prefix)
            self._push(prefix)

    def resume(self, prefix: KeptPrefix) -> None:
        """A running request resumed ``prefix``: its reuse distance is measured, it is
        pinned until :meth:`release`."""
        prefix.reuse_distance = max(1, self.clock - prefix.last_use)
        self._longest = max(self._longest, prefix.reuse_distance)
        prefix.last_use = self.clock
        prefix.num_pins += 1
        if self._idle.pop(prefix, True) is None:
            self._pinned[prefix] = None

    def release(self, prefix: KeptPrefix) -> None:
        """A request that pinned ``prefix`` ended: used now; unpinned by the last one."""
        prefix.num_pins -= 1
        prefix.last_use = self.clock
        if not prefix.num_pins and self._pinned.pop(prefix, True) is None:
            self._idle[prefix] = None
            self._push(prefix)

    def remember(self, prefix: KeptPrefix) -> None:
        """Eviction gave ``prefix`` up wholly: a request that comes back to it later still
        tells its reuse distance (:meth:`recall`). The last ``max_ghosts`` are remembered."""
        ghosts = self._ghosts
        ghosts[prefix.key] = prefix.last_use
        ghosts.move_to_end(prefix.key)
        if len(ghosts) > self._max_ghosts:
            ghosts.popitem(last=False)

    def recall(self, hashes: Sequence[BlockHash]) -> int:
        """The reuse distance of the longest evicted prefix on the path ``hashes`` (which a
        request is admitted with), forgotten now; 0 if none."""
        ghosts = self._ghosts
        if not ghosts:
            return 0
        for key in reversed(hashes):
            last_use = ghosts.pop(key, None)
            if last_use is not None:
                distance = max(1, self.clock - last_use)
                self._longest = max(self._longest, distance)
                return distance
        return 0

    def remove(self, prefix: KeptPrefix) -> None:
        """``prefix`` is no longer kept (its heap entry is dropped lazily)."""
        if self._idle.pop(prefix, True) is not None:
            del self._pinned[prefix]

    def victim(self) -> KeptPrefix:
        """The kept prefix to give up pages next; the caller knows one is kept.

        A stale least recently used prefix, else the one resumed farthest in the future,
        else (all pinned) the least recently pinned one.
        """
        idle = self._idle
        if not idle:
            return next(iter(self._pinned))
        oldest = next(iter(idle))
        if self._longest and self.clock - oldest.last_use > 2 * self._longest:
            return oldest  # idle twice as long as any reuse seen: its conversation is over
        heap = self._heap
        while True:
            _, stamp, prefix = heap[0]
            if prefix.stamp == -stamp and prefix in idle:
                return prefix
            heapq.heappop(heap)

    def _push(self, prefix: KeptPrefix) -> None:
        self._stamps += 1
        prefix.stamp = self._stamps
        heap = self._heap
        if len(heap) > 2 * len(self._idle) + 64:  # mostly stale entries: rebuild
            heap[:] = [self._entry(p) for p in self._idle]
            heapq.heapify(heap)
        else:
            heapq.heappush(heap, self._entry(prefix))

    def _entry(self, prefix: KeptPrefix) -> tuple[int, int, KeptPrefix]:
        return (-self.predicted_resume(prefix), -prefix.stamp, prefix)

    def check_integrity(self) -> None:
        """Assert that pinned prefixes are exactly those with pins, and each idle one has
        a current heap entry."""
        assert not set(self._idle) & set(self._pinned)
        assert len(self._ghosts) <= self._max_ghosts
        for prefix in self._pinned:
            assert prefix.num_pins > 0, prefix.num_pins
        current = {-stamp for _, stamp, _ in self._heap}
        for prefix in self._idle:
            assert prefix.num_pins == 0, prefix.num_pins
            assert prefix.stamp in current, "an idle prefix is missing from the heap"
