"""The scheduler's side of the connector: what a tier can resume, and what to save.

For a request and its local prefix hit, :meth:`KVConnector.plan_load` finds the longest
prefix every group can resume from its local pages and the tiers together, with each
policy's own ``longest_hit`` (the same fixed point as ``KVCacheManager.lookup``), and
admits the request with a fresh page for every other block a group needs live there::

    bs=4, W=6, one full and one window group, local hit 8, tier holds blocks 0..4
    full    [ p3 | p7 | L  | L  | L  ]   p: local hit pages, L: fresh pages to load
    window  [ 0  | 0  | 0  | L  | L  ]   only the window before the boundary at 20

When that does not fit the pool, a shorter prefix is tried (load what fits), down to the
local hit. A failed load is reported per (group, block); the connector forgets those
keys, so the request's next lookup resumes the longest prefix that every group can still
resume, and the rest is recomputed.

Saves follow the same rule backwards. A full-attention group stores every block; a
window group stores only what a resume needs: the blocks live at the next boundary of
``save_interval`` tokens (saved as they fill) and at the request's last filled block when
it ends. Any policy works through ``live_block_spans`` (a block that is live at some later
boundary is assumed live at the next one, as for windows, sinks and chunks). A state group
(mamba-like) is one of those: it stores the checkpoint a resume needs, the state page of
the block before the boundary, where the request kept one (at its end always; at an
interval boundary where a checkpoint falls on it), and a tier resumes a request only where
every group, state groups included, can resume.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import attrs

from hybridkv.memory.hashing import BlockHash
from hybridkv.memory.manager import KVCacheManager, KVRequest, PrefixHit
from hybridkv.memory.offload.config import OffloadConfig
from hybridkv.memory.offload.errors import OffloadConfigError, TierUnavailableError
from hybridkv.memory.offload.keys import KeySpace, salt_of
from hybridkv.memory.offload.lookups import TierLookups
from hybridkv.memory.offload.transfers import BlockLoad, BlockSave, LoadTask
from hybridkv.policies.base import MemoryPolicy, Span

#: Keys of recent saves remembered, so a block computed twice is stored once.
_RECENT_SAVES = 1 << 18


class LookupPending:
    """What :meth:`KVConnector.plan_load` returns while a remote tier has not answered."""


LOOKUP_PENDING = LookupPending()


@attrs.frozen
class PlannedLoad:
    """A request admitted to load: the task, the prefix it resumes, its slowest tier."""

    task: LoadTask
    num_tokens: int
    num_local_tokens: int
    tier_name: str


class KVConnector:
    """Lookups, admissions to load, and saves, for one engine (not thread-safe).

    Args:
        config: The tiers and settings.
        keys: The model's key space (from the executor).
        kv: The engine's KV cache manager.
    """

    def __init__(self, config: OffloadConfig, keys: KeySpace, kv: KVCacheManager) -> None:
        if not kv.enable_prefix_caching:
            raise OffloadConfigError("KV offload needs prefix caching (block hashes)")
        if len(keys.group_kinds) != kv.num_groups:
            raise OffloadConfigError(
                f"the key space names {len(keys.group_kinds)} groups, the pool has {kv.num_groups}"
            )
        bs = kv.block_size
        if config.save_interval % bs:
            raise OffloadConfigError(
                f"save_interval={config.save_interval} is not a multiple of the block size {bs}"
            )
        self.config = config
        self.keys = keys
        self.kv = kv
        self.stats = config.stats
        self._interval = config.save_interval // bs
        self._spans: dict[tuple[MemoryPolicy, int], tuple[Span, ...]] = {}
        self._recent: OrderedDict[bytes, None] = OrderedDict()
        remote = any(tier.is_remote for tier in config.tiers)
        self._check_layout()
        self._lookups = TierLookups(config.tiers) if remote else None

    def _check_layout(self) -> None:
        """Record the rank layout in every shared tier, or refuse one that holds this
        model's blocks cut for another (their ranks' shares could never be loaded here).

        Raises:
            OffloadConfigError: a shared tier's blocks of this model are of another layout.
        """
        keys = self.keys
        if not keys.model:
            return
        marker, layout = keys.layout_key(), keys.layout.encode()
        for tier in self.config.tiers:
            if not tier.is_remote:
                continue
            try:
                (held,) = tier.get([marker])
                if held is None:
                    tier.put([(marker, layout)])
            except TierUnavailableError:
                continue  # it logged why; its blocks count as missing until it is back
            if held is not None and bytes(held) != layout:
                raise OffloadConfigError(
                    f"{tier.name} holds this model's KV blocks cut for {bytes(held).decode()}; "
                    f"this engine is {keys.layout}, whose ranks could never load them: use "
                    f"another tier, or delete the key {marker.decode()} and the model's blocks"
                )

    def shared_stores(self) -> dict[str, str]:
        """Per tier that other engines read (by its name), the store and key space its
        blocks are in: engines of one model and layout on one store name it alike. A
        network call for a remote tier; one that cannot answer is left out."""
        stores = {}
        for tier in self.config.tiers:
            try:
                store = tier.store_id()
            except TierUnavailableError:
                continue  # it logged why
            if store is not None:
                stores[tier.name] = f"{store}/{self.keys.fingerprint}"
        return stores

    # -- loads -------------------------------------------------------------------------

    def plan_load(self, request: KVRequest, hit: PrefixHit) -> PlannedLoad | LookupPending | None:
        """Admit ``request`` to load what the tiers add to ``hit``; None (nothing to add,
        or not even the shortest such prefix fits the pool: nothing changed); or
        :data:`LOOKUP_PENDING` while a remote tier's answer is on its way (``lookups.py``).
        """
        bs, kv = self.kv.block_size, self.kv
        local = hit.num_tokens // bs
        if len(hit.hashes) <= local:
            return None
        salt = salt_of(request.extra_keys)
        sources = self._sources(hit, salt, request.request_id)
        if sources is None:
            return LOOKUP_PENDING
        if self._lookups is not None:
            self._lookups.forget(request.request_id)  # answers are used once
        num = self._longest(len(hit.hashes), sources)
        while num > local:
            placed = kv.admit_loading(request, hit, num * bs)
            if placed is not None:
                loads = [
                    BlockLoad(g, i, page, self.keys.key(g, hit.hashes[i], salt), sources[g][i])
                    for g, pairs in enumerate(placed)
                    for i, page in pairs
                ]
                slowest = max((load.tier for load in loads), default=0)
                return PlannedLoad(
                    task=LoadTask(request.request_id, tuple(loads)),
                    num_tokens=num * bs,
                    num_local_tokens=hit.num_tokens,
                    tier_name=self.config.tiers[slowest].name,
                )
            # Load what fits: a shorter prefix every group can resume.
            num = self._longest((num + local) // 2 if num - local > 1 else local, sources)
        return None

    def forget(self, keys: Sequence[bytes]) -> None:
        """Drop keys whose load failed from every tier, so no lookup offers them again."""
        for key in keys:
            self._recent.pop(key, None)
        for tier in self.config.tiers:
            try:
                tier.delete(keys)
            except TierUnavailableError:
                continue

    def forget_lookups(self, request_id: str) -> None:
        """Drop a request's remote answers (it ended before using them)."""
        if self._lookups is not None:
            self._lookups.forget(request_id)

    def close(self) -> None:
        """Stop the lookup worker, if any."""
        if self._lookups is not None:
            self._lookups.close()

    def _sources(self, hit: PrefixHit, salt: str, request_id: str) -> list[list[int]] | None:
        """Per group and block, -1 where the hit holds a page, the first tier holding it,
        or ``len(tiers)`` where none does (a tier that fails holds nothing); None while a
        remote tier has not answered."""
        num_groups, num_blocks = self.kv.num_groups, len(hit.hashes)
        missing = len(self.config.tiers)
        sources = [[missing] * num_blocks for _ in range(num_groups)]
        wanted: list[tuple[int, int]] = []
        for g in range(num_groups):
            table = hit.block_tables[g] if hit.num_tokens else ()
            for i in range(num_blocks):
                if i < len(table) and table[i]:
                    sources[g][i] = -1
                else:
                    wanted.append((g, i))
        for t, tier in enumerate(self.config.tiers):
            if not wanted:
                break
            keys = [self.keys.key(g, hit.hashes[i], salt) for g, i in wanted]
            if self._lookups is not None and tier.is_remote:
                answered = self._lookups.answer(request_id, t, keys)
                if answered is None:
                    return None
                found = answered
            else:
                try:
                    found = tier.contains(keys)
                except TierUnavailableError:
                    continue
            still = []
            for (g, i), is_there in zip(wanted, found, strict=True):
                if is_there:
                    sources[g][i] = t
                else:
                    still.append((g, i))
            wanted = still
        return sources

    def _longest(self, num: int, sources: list[list[int]]) -> int:
        """The longest prefix of at most ``num`` blocks that every group can resume."""
        missing = len(self.config.tiers)
        bs = self.kv.block_size
        while num > 0:
            start = num
            for policy, row in zip(self.kv.policies, sources, strict=True):

                def is_there(i: int, row: list[int] = row) -> bool:
                    return row[i] != missing

                num = policy.longest_hit(num, bs, is_there)
            if num == start:
                break
        return num

    # -- saves -------------------------------------------------------------------------

    def saves_filled(
        self, request: KVRequest, start: int, stop: int, *, is_end: bool = False
    ) -> list[BlockSave]:
        """Saves for ``request``'s blocks ``start .. stop-1``, which a step just filled
        (``is_end``: it ends there, so also what a resume at ``stop`` needs)."""
        kv = self.kv
        tables = kv.block_tables(request.request_id)
        hashes = kv.block_hashes(request.request_id)
        salt = salt_of(request.extra_keys)
        stop = min(stop, len(hashes))
        out: list[BlockSave] = []
        for g, (policy, table) in enumerate(zip(kv.policies, tables, strict=True)):
            blocks: set[int] = set()
            for i in range(start, stop):
                boundary = (i // self._interval + 1) * self._interval
                if _is_live(self._live(policy, boundary), i):
                    blocks.add(i)
            if is_end and stop:
                for first, end in self._live(policy, stop):
                    blocks.update(range(first, min(end, stop)))
            for i in sorted(blocks):
                page = table[i] if i < len(table) else 0
                if page:
                    self._add_save(out, g, page, hashes[i], salt)
        return out

    def supersede(self, request: KVRequest, resumed: int, end: int) -> None:
        """``request`` resumed at block ``resumed`` and ends at block ``end``: drop from the
        tiers the window blocks only a resume at ``resumed`` needed (a conversation moves
        on; its next turn resumes at ``end``), so they do not push out blocks still needed.
        Full-attention groups lose nothing: every block is live at ``end``."""
        hashes = self.kv.block_hashes(request.request_id)
        salt = salt_of(request.extra_keys)
        stale: list[bytes] = []
        for g, policy in enumerate(self.kv.policies):
            needed = self._live(policy, end)
            for first, stop in self._live(policy, resumed):
                for i in range(first, min(stop, resumed, len(hashes))):
                    boundary = (i // self._interval + 1) * self._interval
                    if not _is_live(needed, i) and not _is_live(self._live(policy, boundary), i):
                        stale.append(self.keys.key(g, hashes[i], salt))
        if stale:
            self.forget(stale)

    def _add_save(
        self, out: list[BlockSave], group: int, page: int, block_hash: BlockHash, salt: str
    ) -> None:
        key = self.keys.key(group, block_hash, salt)
        recent = self._recent
        if key in recent:
            return
        recent[key] = None
        if len(recent) > _RECENT_SAVES:
            recent.popitem(last=False)
        out.append(BlockSave(group, page, key))

    def _live(self, policy: MemoryPolicy, num_blocks: int) -> tuple[Span, ...]:
        spans = self._spans.get((policy, num_blocks))
        if spans is None:
            bs = self.kv.block_size
            spans = self._spans[policy, num_blocks] = policy.live_block_spans(num_blocks * bs, bs)
            if len(self._spans) > 4096:
                self._spans.clear()
        return spans


def _is_live(spans: tuple[Span, ...], block: int) -> bool:
    return any(first <= block < stop for first, stop in spans)
