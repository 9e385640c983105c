"""Prefix-cache events: which blocks became findable, and which stopped being so, per tier.

The pool, and the offload tiers that observe their stores, report every change of what a
request could resume from to a :class:`CacheEventLog`; whoever drives the engine takes the
events gathered since the last step (``take``) and hands them to a publisher
(``hybridkv.parallel.kv_events`` speaks vLLM's wire format). Nothing here knows a socket::

    pool.cache_blocks    block i of group g gets its hash     -> BlockStored  (device)
    pool evicts / uncache the hash leaves the map               -> BlockRemoved (device)
    tier put / drop      a key enters or leaves host or Redis   -> BlockStored / BlockRemoved

A stored event covers a run of consecutive blocks of one group: the hash of each, the
hash of the block before the run (None for a request's first block) and the run's
tokens, so a consumer can chain the hashes itself (``hybridkv.memory.hashing``). A tier
knows keys, not tokens: its stored events carry no tokens and no parent.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

import attrs

from hybridkv.memory.hashing import BlockHash
from hybridkv.policies.base import MemoryPolicy

#: Where a block lives: the engine's own pool, or an offload tier (its ``Tier.name``).
DEVICE = "device"

# The kind names vLLM's events use for its cache specs, where a policy has a counterpart.
_VLLM_KINDS = {
    "full": "full_attention",
    "sliding_window": "sliding_window",
    "chunked_local": "chunked_local_attention",
    "mamba": "mamba",
}


@attrs.frozen(kw_only=True)
class GroupInfo:
    """What a consumer needs to tell one KV group's blocks from another's.

    Attributes:
        index: The group's index in the pool (``group_idx`` on the wire).
        kind: vLLM's name of the group's cache kind where it has one (``full_attention``,
            ``sliding_window``, ``mamba``, ...), else the policy's registry name.
        block_size: Tokens per block.
        sliding_window: Keys a query reads, itself included, for a one-window policy.
        keeps_state: A mamba-like group: a page holds the state after its block's tokens.
    """

    index: int
    kind: str
    block_size: int
    sliding_window: int | None
    keeps_state: bool

    @classmethod
    def of(cls, index: int, policy: MemoryPolicy, block_size: int) -> GroupInfo:
        """The info of group ``index`` kept under ``policy``."""
        window = policy.attention_window()
        return cls(
            index=index,
            kind=_VLLM_KINDS.get(policy.name, policy.name or type(policy).__name__),
            block_size=block_size,
            sliding_window=None if window is None else window.size,
            keeps_state=policy.keeps_state,
        )


@attrs.frozen(kw_only=True)
class BlockStored:
    """Consecutive blocks of one group became findable in ``medium``.

    Attributes:
        group: The group.
        block_hashes: Each block's chained hash, in order.
        parent_hash: The hash of the block before the first (None: the first is a
            request's block 0, or a tier's store, which knows no parent).
        token_ids: The blocks' tokens (``block_size`` each; empty from a tier).
        medium: ``device`` or a tier name (``host``, ``redis``).
        checkpoint_positions: For a state group, per block, the tokens its state covers
            (the end of the block); None for K/V groups.
    """

    group: GroupInfo
    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    medium: str
    checkpoint_positions: tuple[int, ...] | None = None


@attrs.frozen(kw_only=True)
class BlockRemoved:
    """Blocks of one group stopped being findable in ``medium``."""

    group: GroupInfo
    block_hashes: tuple[BlockHash, ...]
    medium: str


@attrs.frozen
class AllBlocksCleared:
    """Every block of every group and medium is gone (an engine starting afresh)."""


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class CacheEventSink(Protocol):
    """Takes the events of one engine step, in order, and must never block for long."""

    def publish(self, events: Sequence[CacheEvent]) -> None:
        """Send one step's events (never called with none)."""
        ...


class CacheEventLog:
    """Gathers cache events from the pool (the engine's thread) and the offload tiers
    (their own threads) in the order they happen; :meth:`take` empties it.

    Removals of one group and medium in a row merge into one event, as a step's evictions
    come one page at a time.

    Args:
        groups: Every group's info, in group order.
    """

    def __init__(self, groups: Sequence[GroupInfo]) -> None:
        self.groups = tuple(groups)
        self._events: list[CacheEvent] = []
        # The removal being merged into: (group, medium, hashes), appended to in place.
        self._removing: tuple[int, str, list[BlockHash]] | None = None
        self._lock = threading.Lock()

    def stored(
        self,
        group: int,
        hashes: Sequence[BlockHash],
        first: int,
        stop: int,
        token_ids: Sequence[int],
    ) -> None:
        """Blocks ``first .. stop-1`` of ``group`` became findable in the pool; ``hashes``
        is the request's whole hash list and ``token_ids`` its tokens."""
        info = self.groups[group]
        bs = info.block_size
        positions = tuple(bs * (i + 1) for i in range(first, stop)) if info.keeps_state else None
        event = BlockStored(
            group=info,
            block_hashes=tuple(hashes[first:stop]),
            parent_hash=hashes[first - 1] if first else None,
            token_ids=tuple(token_ids[first * bs : stop * bs]),
            medium=DEVICE,
            checkpoint_positions=positions,
        )
        with self._lock:
            self._append(event)

    def removed(self, group: int, block_hash: BlockHash, medium: str = DEVICE) -> None:
        """``block_hash`` of ``group`` stopped being findable in ``medium``."""
        with self._lock:
            removing = self._removing
            if removing is not None and removing[0] == group and removing[1] == medium:
                removing[2].append(block_hash)
                return
            self._close_removal()
            self._removing = (group, medium, [block_hash])

    def stored_keys(self, medium: str, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        """``medium`` now holds these (group, hash) blocks, known by key alone."""
        with self._lock:
            for group, block_hash in blocks:
                self._append(
                    BlockStored(
                        group=self.groups[group],
                        block_hashes=(block_hash,),
                        parent_hash=None,
                        token_ids=(),
                        medium=medium,
                    )
                )

    def removed_keys(self, medium: str, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        """``medium`` dropped these (group, hash) blocks."""
        for group, block_hash in blocks:
            self.removed(group, block_hash, medium)

    def cleared(self) -> None:
        """Every block is gone."""
        with self._lock:
            self._append(AllBlocksCleared())

    def take(self) -> list[CacheEvent]:
        """The events gathered since the last call, oldest first."""
        with self._lock:
            self._close_removal()
            events, self._events = self._events, []
        return events

    def _append(self, event: CacheEvent) -> None:
        self._close_removal()
        self._events.append(event)

    def _close_removal(self) -> None:
        removing, self._removing = self._removing, None
        if removing is not None:
            group, medium, hashes = removing
            info = self.groups[group]
            self._events.append(BlockRemoved(group=info, block_hashes=tuple(hashes), medium=medium))
