"""The router: the prefill a replica saves against the load it joins, from the replicas'
KV events, with a memory of where a prefix was just sent."""

from __future__ import annotations

import pytest

from hybridkv.memory.cache_events import BlockStored, GroupInfo
from hybridkv.memory.hashing import BlockHasher
from hybridkv.parallel.kv_event_wire import encode_batch
from hybridkv.parallel.kv_index import ReplicaIndex
from hybridkv.parallel.kv_router import PrefixRouter, ReplicaLoad, RouterWeights
from hybridkv.policies import FullAttention, MambaLike

BS = 4
PROMPT = list(range(1, 42))  # ten blocks of 4, then the last token
GROUPS = [GroupInfo.of(i, p, BS) for i, p in enumerate([FullAttention(), MambaLike()])]


def holding(num_blocks: int, medium: str = "device") -> ReplicaIndex:
    """A replica whose events stored the first ``num_blocks`` blocks of PROMPT in every
    group, in ``medium``."""
    hasher = BlockHasher(BS)
    hashes: list[bytes] = []
    hasher.extend(hashes, hasher.root(()), PROMPT, num_blocks * BS)
    index = ReplicaIndex(BS)
    ends = tuple((i + 1) * BS for i in range(num_blocks))
    events = [
        BlockStored(
            group=group,
            block_hashes=tuple(hashes),
            parent_hash=None,
            token_ids=(),
            medium=medium,
            checkpoint_positions=ends if group.keeps_state else None,
        )
        for group in GROUPS
    ]
    if num_blocks:
        index.apply(0, encode_batch(0.0, events))
    return index


def test_the_longer_resumable_prefix_wins_at_equal_load() -> None:
    router = PrefixRouter({"a": holding(3), "b": holding(8), "c": holding(0)})
    assert router.saved_tokens("b", PROMPT) == 8 * BS
    assert router.choose(PROMPT, {}) == "b"
    # Remembered there: the whole prompt now counts for b until its events catch up.
    assert router.saved_tokens("b", PROMPT) == 10 * BS


def test_load_outweighs_a_short_hit() -> None:
    """Two blocks saved are worth less than four requests queued ahead."""
    router = PrefixRouter({"a": holding(2), "b": holding(0)}, RouterWeights(tokens_per_request=8))
    busy = {"a": ReplicaLoad(num_waiting=3, num_running=1)}
    assert router.choose(PROMPT, busy) == "b"
    assert router.choose([90, 91, 92], {}) in {"a", "b"}  # no hit: the less loaded


def test_a_tier_hit_counts_less_than_one_in_the_pool() -> None:
    """Eight blocks in a host tier (discounted to four) lose to six in a pool."""
    router = PrefixRouter({"tier": holding(8, "host"), "pool": holding(6)})
    assert router.saved_tokens("tier", PROMPT) == 0.5 * 8 * BS
    assert router.choose(PROMPT, {}) == "pool"


def test_a_shared_prefix_follows_the_first_sighting_before_any_event() -> None:
    """No replica has published anything yet: the first request goes to the less loaded,
    and a second one sharing its prefix goes there too, though it is now busier."""
    router = PrefixRouter({"a": holding(0), "b": holding(0)}, RouterWeights(tokens_per_request=4))
    first = router.choose(PROMPT, {"a": ReplicaLoad(num_running=1)})
    assert first == "b"
    follow_up = [*PROMPT[:-1], 60, 61, 62, 63, 64]
    assert router.choose(follow_up, {"b": ReplicaLoad(num_running=1)}) == "b"


def test_replicas_of_different_block_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="block size"):
        PrefixRouter({"a": ReplicaIndex(4), "b": ReplicaIndex(8)})
