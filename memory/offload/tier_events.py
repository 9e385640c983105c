"""The offload tiers' stores and drops, reported as KV cache events of their medium.

A tier knows keys (``keys.py``), and a key names its group and chained block hash, which
is what a consumer of the events indexes by; the tokens are not in a key, so a tier's
stored events carry none (a consumer finds them in the device event of the same hash).
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.memory.cache_events import CacheEventLog
from hybridkv.memory.hashing import BlockHash
from hybridkv.memory.offload.keys import parse_key
from hybridkv.memory.offload.tier import Tier


class TierEvents:
    """A :class:`~hybridkv.memory.offload.tier.TierObserver` writing into a log.

    Args:
        log: Where the events go (the pool's log: one order for every medium).
    """

    def __init__(self, log: CacheEventLog) -> None:
        self.log = log

    def observe(self, tiers: Sequence[Tier]) -> None:
        """Report every store and drop of ``tiers`` from now on."""
        for tier in tiers:
            tier.observer = self

    def stored(self, tier: str, keys: Sequence[bytes]) -> None:
        """``tier`` holds ``keys`` now."""
        blocks = _blocks(keys)
        if blocks:
            self.log.stored_keys(tier, blocks)

    def removed(self, tier: str, keys: Sequence[bytes]) -> None:
        """``tier`` dropped ``keys``."""
        blocks = _blocks(keys)
        if blocks:
            self.log.removed_keys(tier, blocks)


def _blocks(keys: Sequence[bytes]) -> list[tuple[int, BlockHash]]:
    """The (group, block hash) of the block keys among ``keys`` (a tier's layout marker,
    ``KeySpace.layout_key``, is none)."""
    return [parse_key(key) for key in keys if key.startswith(b"hkv:")]
