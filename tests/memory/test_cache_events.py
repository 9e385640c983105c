"""Prefix-cache events: a consumer that follows them knows what the pool holds."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from hybridkv.memory import BlockHash, BlockHasher, KVCacheManager
from hybridkv.memory.cache_events import (
    DEVICE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheEvent,
    CacheEventLog,
    GroupInfo,
)
from hybridkv.policies import FullAttention, MambaLike, SlidingWindow
from tests.conftest import FakeRequest

BS = 4
POLICIES = [FullAttention(), SlidingWindow(window=6), MambaLike()]


class Consumer:
    """What a router indexes: (medium, group, hash), rebuilt from events alone; checks
    that every stored hash is the chain of its parent and tokens."""

    def __init__(self) -> None:
        self.blocks: set[tuple[str, int, BlockHash]] = set()
        self.hasher = BlockHasher(BS)

    def apply(self, events: list[CacheEvent]) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self.blocks.discard((event.medium, event.group.index, h))
            else:
                self.check_chain(event)
                for h in event.block_hashes:
                    self.blocks.add((event.medium, event.group.index, h))

    def check_chain(self, event: BlockStored) -> None:
        if not event.token_ids:
            return
        root = event.parent_hash or self.hasher.root(())
        hashes: list[BlockHash] = []
        self.hasher.extend(hashes, root, event.token_ids, len(event.token_ids))
        assert tuple(hashes) == event.block_hashes


def pool_blocks(mgr: KVCacheManager) -> set[tuple[str, int, BlockHash]]:
    return {(DEVICE, g, h) for g in range(mgr.num_groups) for h in mgr.pool.cached_blocks(g)}


def attach(mgr: KVCacheManager) -> CacheEventLog:
    log = CacheEventLog([GroupInfo.of(g, p, BS) for g, p in enumerate(mgr.policies)])
    mgr.pool.events = log
    return log


def test_group_info_names_vllm_kinds_and_windows() -> None:
    """Each group carries vLLM's kind name, its window, and whether it keeps states."""
    infos = [GroupInfo.of(g, p, BS) for g, p in enumerate(POLICIES)]
    assert [(i.kind, i.sliding_window, i.keeps_state) for i in infos] == [
        ("full_attention", None, False),
        ("sliding_window", 6, False),
        ("mamba", None, True),
    ]


def test_a_state_group_reports_where_its_states_end() -> None:
    """A mamba-like group's stored blocks carry the token count each state covers."""
    mgr = KVCacheManager(POLICIES, num_blocks=40, block_size=BS)
    log = attach(mgr)
    mgr.allocate(FakeRequest("r", list(range(13))), 13, mgr.lookup(FakeRequest("r", [])))
    stored = [e for e in log.take() if isinstance(e, BlockStored) and e.group.keeps_state]
    assert stored and all(e.checkpoint_positions for e in stored)
    for event in stored:
        assert event.checkpoint_positions is not None
        assert all(p % BS == 0 and 0 < p <= 12 for p in event.checkpoint_positions)


prompts = st.lists(
    st.lists(st.integers(0, 3), min_size=1, max_size=6).map(lambda p: [1, 2, 3, 4, *p]),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(prompts=prompts, decodes=st.lists(st.integers(0, 9), min_size=12, max_size=12))
def test_a_consumer_of_the_events_holds_what_the_pool_caches(
    prompts: list[list[int]], decodes: list[int]
) -> None:
    """After admissions, decodes, frees and evictions in a small pool, the blocks the
    events name are exactly the pool's prefix-cache map, every group."""
    mgr = KVCacheManager(POLICIES, num_blocks=14, block_size=BS)
    log, consumer = attach(mgr), Consumer()
    for k, prompt in enumerate(prompts * 2):
        request = FakeRequest(f"r{k}", list(prompt))
        hit = mgr.lookup(request)
        if mgr.allocate(request, len(prompt) - hit.num_tokens, hit) is None:
            continue
        for token in range(decodes[k % len(decodes)]):
            request.all_token_ids.append(token)
            if mgr.allocate(request, 1) is None:
                break
        mgr.free(request.request_id, computed=k % 5 != 4)
        consumer.apply(log.take())
        assert consumer.blocks == pool_blocks(mgr)
