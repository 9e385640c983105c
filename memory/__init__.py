"""Pages for every KV group from one pool: the pool, prefix hashing, the manager, layout."""

from hybridkv.memory.errors import CapacityError, LayoutError, PromptTooLongError
from hybridkv.memory.hashing import BlockHash, BlockHasher, hash_names
from hybridkv.memory.interface import NO_NEW_BLOCKS, KVRequest, KVUsage, PrefixHit, StaleHitError
from hybridkv.memory.layout import (
    AttentionSpec,
    KVGroup,
    LayerSpec,
    LayoutPlan,
    NoCacheSpec,
    StateSpec,
)
from hybridkv.memory.manager import KVCacheManager
from hybridkv.memory.pool import NULL_BLOCK, BlockId, BlockPool

__all__ = [
    "NO_NEW_BLOCKS",
    "NULL_BLOCK",
    "AttentionSpec",
    "BlockHash",
    "BlockHasher",
    "BlockId",
    "BlockPool",
    "CapacityError",
    "KVCacheManager",
    "KVGroup",
    "KVRequest",
    "KVUsage",
    "LayerSpec",
    "LayoutError",
    "LayoutPlan",
    "NoCacheSpec",
    "PrefixHit",
    "PromptTooLongError",
    "StaleHitError",
    "StateSpec",
    "hash_names",
]
