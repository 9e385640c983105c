"""What the KV cache manager takes and returns: requests, prefix hits, usage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs

from hybridkv.errors import HybridKVError
from hybridkv.memory.hashing import BlockHash


class StaleHitError(HybridKVError):
    """A prefix hit was used after the pages it named were reused; look it up again."""


class KVRequest(Protocol):
    """What the manager reads of a request."""

    @property
    def request_id(self) -> str: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def extra_keys(self) -> tuple[object, ...]: ...


@attrs.frozen
class PrefixHit:
    """The longest cached prefix usable by every group (from :meth:`KVCacheManager.lookup`).

    Attributes:
        num_tokens: Cached tokens, a multiple of the block size; at least one prompt token
            is always left to compute.
        block_tables: Per group, the table of the hit: the blocks the policy needs to
            resume, the null block elsewhere.
        hashes: The request's block hashes computed so far (kept, not recomputed).
        checkpoints: Token counts past the hit where state groups keep a state as the
            request is computed: the end of the longest prefix the K/V groups have
            cached, where the state groups have none (a prompt that leaves a shared
            prefix: the next request with that prefix resumes at its end).
    """

    num_tokens: int
    block_tables: tuple[tuple[int, ...], ...]
    hashes: list[BlockHash] = attrs.field(eq=False, repr=False)
    checkpoints: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class KVUsage:
    """A snapshot of pool usage and prefix-cache counters."""

    num_blocks: int
    num_free_blocks: int
    blocks_used_per_group: tuple[int, ...]
    prefix_hit_tokens: int
    prefix_query_tokens: int
    #: Pages the state groups hold (a span of page ids each where the state needs it).
    state_pages_used: int = 0
    #: State pages that could be taken now (spans free of pages in use; 0 in a pool
    #: whose state pages are one page id, as every page then is).
    num_free_state_pages: int = 0

    @property
    def kv_pages_used(self) -> int:
        """Pages the K/V groups hold (one page id each)."""
        return sum(self.blocks_used_per_group) - self.state_pages_used

    @property
    def prefix_hit_rate(self) -> float:
        """Cached prompt tokens over prompt tokens looked up, at admission."""
        if not self.prefix_query_tokens:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_query_tokens


#: Returned by an allocation that took no page (most decode steps).
NO_NEW_BLOCKS: tuple[list[int], ...] = ()
