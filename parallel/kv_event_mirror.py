"""The cache an event stream describes, kept by the publisher for late joiners.

The publisher applies every batch it sends, so at any sequence number it can describe
the whole state as one batch a consumer applies after forgetting everything::

    snapshot at seq s  =  [AllBlocksCleared, BlockStored(block) for every block held]

Each block travels alone, with its parent's hash and its tokens, so a consumer needs no
order among them. A tier's blocks carry no tokens (their stores had none).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from hybridkv.memory.cache_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheEvent,
    GroupInfo,
)
from hybridkv.memory.hashing import BlockHash


@attrs.frozen
class _Block:
    group: GroupInfo
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    position: int | None


class CacheMirror:
    """Every block an event stream says is held, by (medium, group, hash)."""

    def __init__(self) -> None:
        self._blocks: dict[tuple[str, int, BlockHash], _Block] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def apply(self, events: Iterable[CacheEvent]) -> None:
        """Follow one batch of events, in order."""
        blocks = self._blocks
        for event in events:
            if isinstance(event, AllBlocksCleared):
                blocks.clear()
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    blocks.pop((event.medium, event.group.index, block_hash), None)
            else:
                self._store(event)

    def _store(self, event: BlockStored) -> None:
        bs = event.group.block_size
        parent = event.parent_hash
        positions = event.checkpoint_positions
        for k, block_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[k * bs : (k + 1) * bs]
            position = None if positions is None else positions[k]
            self._blocks[(event.medium, event.group.index, block_hash)] = _Block(
                event.group, parent, tokens, position
            )
            parent = block_hash

    def snapshot(self) -> list[CacheEvent]:
        """Events that rebuild this state from nothing."""
        events: list[CacheEvent] = [AllBlocksCleared()]
        for (medium, _, block_hash), block in self._blocks.items():
            events.append(
                BlockStored(
                    group=block.group,
                    block_hashes=(block_hash,),
                    parent_hash=block.parent,
                    token_ids=block.token_ids,
                    medium=medium,
                    checkpoint_positions=None if block.position is None else (block.position,),
                )
            )
        return events
