"""The prefix-cache search: the longest cached prefix every group can resume from.

Each group's policy answers for itself (``MemoryPolicy.longest_hit``): a full-attention
group needs every block from 0, a sliding-window group only the blocks its window reads
at the resume point, a state group its checkpoint there. The candidate shrinks until no
group lowers it::

    blocks cached   full     [x x x x x . x]      longest run from 0: 5 blocks
                    window   [. . x x x x x]      W=2 blocks: a run of 2 ending at 5: ok
    hit             5 blocks: every group resumes at 5 * block_size tokens

A fixed point, found in one pass when the groups agree. Where the K/V groups alone would
resume later than the state groups let the hit (a prompt that shares a prefix with an
earlier one but leaves it where no checkpoint was kept), the hit asks the state groups to
keep one there (``PrefixHit.checkpoints``): the next request with that prefix resumes at
its end. Torch-free and pure: it reads the pool's cache maps and changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hybridkv.memory.hashing import BlockHash, BlockHasher
from hybridkv.memory.interface import KVRequest, PrefixHit, StaleHitError
from hybridkv.memory.pool import NULL_BLOCK, BlockPool
from hybridkv.memory.request_blocks import Kind


def find_prefix_hit(
    pool: BlockPool, kinds: Sequence[Kind], hasher: BlockHasher, request: KVRequest
) -> PrefixHit:
    """The longest cached prefix of ``request`` (always short of its last token) that
    every group of ``kinds`` can resume from, with each group's pages of it."""
    tokens = request.all_token_ids
    bs = hasher.block_size
    hashes: list[BlockHash] = []
    max_blocks = (len(tokens) - 1) // bs
    if max_blocks <= 0:
        return PrefixHit(0, (), hashes)
    hasher.extend(hashes, hasher.root(request.extra_keys), tokens, max_blocks * bs)
    num = _longest(pool, kinds, hashes, max_blocks, bs)
    checkpoints: tuple[int, ...] = ()
    kv_kinds = [kind for kind in kinds if not kind[0].keeps_state]
    if len(kv_kinds) < len(kinds) and kv_kinds:
        shared = _longest(pool, kv_kinds, hashes, max_blocks, bs)
        if shared > num:  # the state groups keep no state where this prompt leaves it
            checkpoints = (shared * bs,)
    if num == 0:
        return PrefixHit(0, (), hashes, checkpoints)
    policies = {group: policy for policy, groups in kinds for group in groups}
    pages: list[tuple[int, ...]] = []
    for group in range(len(policies)):
        table: list[int] = [NULL_BLOCK] * num
        cached = pool.cached_blocks(group)
        for first, stop in policies[group].live_block_spans(num * bs, bs):
            for i in range(first, min(stop, num)):
                table[i] = cached[hashes[i]]
        pages.append(tuple(table))
    return PrefixHit(num * bs, tuple(pages), hashes, checkpoints)


def _longest(
    pool: BlockPool,
    kinds: Sequence[Kind],
    hashes: Sequence[BlockHash],
    max_blocks: int,
    bs: int,
) -> int:
    """The most blocks, up to ``max_blocks``, that every group of ``kinds`` resumes from."""
    num = max_blocks
    while True:
        start = num
        for policy, groups in kinds:
            for group in groups:
                cached = pool.cached_blocks(group)

                def is_cached(i: int, cached: Mapping[BlockHash, int] = cached) -> bool:
                    return hashes[i] in cached

                num = policy.longest_hit(num, bs, is_cached)
        if num == start or num == 0:
            return num


def check_hit(pool: BlockPool, hit: PrefixHit) -> None:
    """Raise if a page of ``hit`` was reused since its lookup (its content changed).

    Raises:
        StaleHitError: a page no longer holds the block ``hit`` found in it.
    """
    for group, table in enumerate(hit.block_tables):
        for i, page in enumerate(table):
            if page and pool.lookup(hit.hashes[i], group) != page:
                raise StaleHitError(
                    f"prefix hit page {page} of group {group} was reused since lookup"
                )
