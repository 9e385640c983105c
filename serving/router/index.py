"""A router's index of what each replica can resume, rebuilt from its KV events alone.

A replica's events (``kv_events.py``, vLLM's wire format with hybridkv's group fields)
say, per KV group, which block hashes it holds and where. The index keeps them per
replica and answers, for a token sequence, the longest prefix the replica resumes from
in *every* group: what its own prefix lookup (``memory/prefix_lookup.py``) would find::

    blocks held    full     [x x x x x . x]       a run from block 0: 5
                   window   [. . x x x x x]       the window's blocks before 5: ok
                   mamba    [. . . . x . x]       a checkpoint at the end of block 5: ok
    resumable      5 blocks, in every group

A router that counted only the full-attention run (what Dynamo's and SGLang's routers
read) would credit a replica with prefixes its window or state groups cannot resume.
Each group's rule is the engine's own (``MemoryPolicy.longest_hit``), with the policy
rebuilt from the group's kind and window: exact for full attention, sliding windows and
mamba-like states; a group of another kind is taken as full attention, which needs every
block and so never overstates a hit. Hashes are recomputed as the engine computes them
(``memory/hashing.py``; the guide ``docs/guides/kv-events.md`` gives the seed) and
compared on the wire's 64 bits.

Replicas that share a tier (one Redis server) load one another's blocks from it: asked
with ``peers``, an index counts their blocks in that medium as its own.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import msgpack

from hybridkv.memory.hashing import BlockHash, BlockHasher
from hybridkv.parallel.kv_event_wire import MEDIUM, wire_hash
from hybridkv.policies import FullAttention, MambaLike, MemoryPolicy, SlidingWindow

#: The pool's medium on the wire (tiers are ``CPU`` and ``REDIS``).
DEVICE_MEDIUM = MEDIUM["device"]
_NONE: set[int] = set()


def policy_of(kind: str, sliding_window: int | None) -> MemoryPolicy:
    """The policy whose ``longest_hit`` a group of ``kind`` follows (see the module)."""
    if kind == "sliding_window" and sliding_window is not None:
        return SlidingWindow(window=sliding_window)
    if kind == "mamba":
        return MambaLike()
    return FullAttention()


class ReplicaIndex:
    """One replica's held blocks, per medium and group, from its event batches.

    Args:
        block_size: The replica's tokens per block (every group's).
        hash_algorithm: Its prefix-cache hash (``sha256`` or ``xxh3``; the engine's).
    """

    def __init__(self, block_size: int, hash_algorithm: str = "sha256") -> None:
        self._hasher = BlockHasher(block_size, hash_algorithm)
        self._held: dict[tuple[str, int], set[int]] = {}
        self._policies: dict[int, MemoryPolicy] = {}
        self.last_seq = -1

    @property
    def hasher(self) -> BlockHasher:
        """How it hashes a prompt's blocks (the replica's block size and algorithm)."""
        return self._hasher

    def apply(self, seq: int, payload: bytes) -> None:
        """Follow one published batch (``seq``: its sequence number; older ones, a
        replay overlapping what arrived, are skipped)."""
        if seq <= self.last_seq:
            return
        _, events, _ = msgpack.unpackb(payload)
        for event in events:
            tag = event[0]
            if tag == "AllBlocksCleared":
                self._held.clear()
            elif tag == "BlockRemoved":
                _, hashes, medium, group = event[:4]
                self._held.get((medium, group), set()).difference_update(hashes)
            else:
                hashes, medium, group, kind, window = (
                    event[1], event[6], event[9], event[10], event[11]
                )  # fmt: skip
                self._policies.setdefault(group, policy_of(kind, window))
                self._held.setdefault((medium, group), set()).update(hashes)
        self.last_seq = seq

    def resumable(
        self,
        token_ids: Sequence[int],
        extra_keys: tuple[Hashable, ...] = (),
        medium: str = DEVICE_MEDIUM,
    ) -> int:
        """Tokens of ``token_ids`` the replica resumes from ``medium`` in every group,
        short of the last token (which a step always runs), as its engine would."""
        return self.resumable_blocks(self.wire_hashes(token_ids, extra_keys), medium) * (
            self._hasher.block_size
        )

    def wire_hashes(
        self, token_ids: Sequence[int], extra_keys: tuple[Hashable, ...] = ()
    ) -> list[int]:
        """The wire hashes of the blocks of ``token_ids`` a hit may cover: the full
        blocks short of the last token."""
        bs = self._hasher.block_size
        max_blocks = max(0, (len(token_ids) - 1) // bs)
        hashes: list[BlockHash] = []
        self._hasher.extend(hashes, self._hasher.root(extra_keys), token_ids, max_blocks * bs)
        return [wire_hash(h) for h in hashes]

    def resumable_blocks(
        self,
        wire: Sequence[int],
        medium: str = DEVICE_MEDIUM,
        *,
        full_attention_only: bool = False,
        peers: Sequence[ReplicaIndex] = (),
    ) -> int:
        """Blocks of a prompt (its ``wire_hashes``) the replica resumes from ``medium`` in
        every group: the engine's fixed point, until no group lowers it. With
        ``full_attention_only``, only the full-attention groups are asked (what a router
        that reads their events alone believes). ``peers``: replicas whose ``medium`` is
        the same store as this one's (a shared Redis), whose blocks there count too.

        A hit needs every block of a full-attention group, so their run (a scan to the
        first miss) bounds it, and the other groups are searched below that bound only:
        on a Bamba-like layout of 10 state groups, a quarter of the time at 4 replicas
        (``benchmarks/routing/policies.py``)."""
        indexes = (self, *peers)
        if not any(key[0] == medium for index in indexes for key in index._held):
            return 0
        policies = self._policies
        for peer in peers:
            policies = peer._policies | policies
        full: dict[int, MemoryPolicy] = {
            g: p for g, p in policies.items() if isinstance(p, FullAttention)
        }
        if full:
            wire = wire[: self._fixed_point(wire, medium, full, indexes)]
        if full_attention_only or len(full) == len(policies):
            return len(wire) if full else 0
        return self._fixed_point(wire, medium, policies, indexes)

    def _fixed_point(
        self,
        wire: Sequence[int],
        medium: str,
        policies: dict[int, MemoryPolicy],
        indexes: Sequence[ReplicaIndex],
    ) -> int:
        num = len(wire) if policies else 0
        while num:
            start = num
            for group, policy in policies.items():
                helds = [index._held.get((medium, group), _NONE) for index in indexes]
                num = policy.longest_hit(num, self._hasher.block_size, _is_held(wire, helds))
            if num == start:
                break
        return num


def _is_held(wire: Sequence[int], helds: list[set[int]]) -> Callable[[int], bool]:
    """Whether block ``i`` of ``wire`` is in any of ``helds``."""
    if len(helds) == 1:
        (held,) = helds
        return lambda i: wire[i] in held
    return lambda i: any(wire[i] in held for held in helds)


__all__ = ["DEVICE_MEDIUM", "ReplicaIndex", "policy_of"]
