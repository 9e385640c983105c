"""How long a request a replica's pool could take now: free pages seen from a router.

A router weighing replicas sees a pool's free pages as a number of prompt tokens: the
longest request whose pages (every group's, a state page counting its span) the free
pages hold, as :meth:`~hybridkv.memory.manager.KVCacheManager.num_blocks_needed` counts
them::

    free pages 40, full + window(16), block 8:  needed(t) = ceil(t/8) + min(ceil(t/8), 3)
    headroom   = the largest t with needed(t) <= 40  =  37 blocks of 8 = 296 tokens

A prompt whose uncomputed tokens exceed it waits there for a running request to end (or
preempts one). Cached free pages count as free, as an allocation may evict them; a pool
of state spans may still lack a whole free span (``num_free_state_pages`` says), so this
is an upper bound there.
"""

from __future__ import annotations

from hybridkv.memory.manager import KVCacheManager


def token_headroom(kv: KVCacheManager, num_free_blocks: int, limit: int) -> int:
    """The most tokens, up to ``limit``, a new request could hold pages for in
    ``num_free_blocks`` free pages of ``kv``'s pool (a bisection over
    ``num_blocks_needed``, which never falls as tokens grow)."""
    if kv.num_blocks_needed(limit) <= num_free_blocks:
        return limit
    fits, short = 0, limit  # needed(fits) <= free < needed(short)
    while short - fits > 1:
        middle = (fits + short) // 2
        if kv.num_blocks_needed(middle) <= num_free_blocks:
            fits = middle
        else:
            short = middle
    return fits


__all__ = ["token_headroom"]
