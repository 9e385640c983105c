"""The router: the prefill a replica saves against the load it joins, from the replicas'
KV events, with a memory of where a prefix was just sent."""

from __future__ import annotations

import pytest

from hybridkv.memory.cache_events import BlockStored, GroupInfo
from hybridkv.memory.hashing import BlockHasher
from hybridkv.parallel.kv_event_wire import encode_batch
from hybridkv.policies import FullAttention, MambaLike
from hybridkv.serving.router.index import ReplicaIndex
from hybridkv.serving.router.ranking import (
    LeastLoaded,
    PrefixRouter,
    ReplicaLoad,
    RoundRobin,
    RouterWeights,
)

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


def test_load_beyond_the_slack_outweighs_a_short_hit() -> None:
    """Two blocks saved (8 tokens) are worth less than two requests beyond the slack (16
    tokens), and more than one (8 tokens: a tie, which the less loaded wins)."""
    weights = RouterWeights(tokens_per_request=8, slack_requests=2, slack_ratio=0.0)
    router = PrefixRouter({"a": holding(2), "b": holding(0)}, weights)

    def first(load: ReplicaLoad) -> str:
        return router.rank(PROMPT, {"a": load}, ["a", "b"])[0]

    assert first(ReplicaLoad(num_waiting=3, num_running=1)) == "b"
    assert first(ReplicaLoad(num_running=3)) == "b"
    assert first(ReplicaLoad(num_running=2)) == "a"


def test_within_the_slack_the_hit_decides_however_busy_every_replica_is() -> None:
    """Load counts from the least loaded candidate up: with every replica busy, a hit
    still wins over a replica as busy as the least loaded plus the slack (here half of
    its ten requests)."""
    weights = RouterWeights(tokens_per_request=1000, slack_requests=1, slack_ratio=0.5)
    router = PrefixRouter({"a": holding(2), "b": holding(0)}, weights)
    assert (
        router.choose(PROMPT, {"a": ReplicaLoad(num_running=15), "b": ReplicaLoad(num_running=10)})
        == "a"
    )
    assert (
        router.choose(PROMPT, {"a": ReplicaLoad(num_running=16), "b": ReplicaLoad(num_running=10)})
        == "b"
    )


def test_a_replica_whose_free_pages_cannot_hold_the_prompt_counts_one_request_more() -> None:
    """A replica short of pages for what the prompt must compute makes it wait: one
    request's cost, which a hit longer than that still outweighs."""
    weights = RouterWeights(tokens_per_request=16, slack_requests=4)
    router = PrefixRouter({"a": holding(2), "b": holding(0)}, weights)
    full = ReplicaLoad(free_tokens=8)  # a must compute 33 of the 41 tokens
    assert router.rank(PROMPT, {"a": full}, ["a", "b"])[0] == "b"
    assert router.rank(PROMPT, {"a": ReplicaLoad(free_tokens=33)}, ["a", "b"])[0] == "a"
    assert router.rank(PROMPT, {"a": ReplicaLoad()}, ["a", "b"])[0] == "a"  # not reported
    # Six blocks saved (24 tokens) outweigh the wait (16): the prompt still goes to a.
    router.set_index("a", holding(6))
    assert router.rank(PROMPT, {"a": full}, ["a", "b"])[0] == "a"


def test_prompts_without_a_hit_go_where_the_least_was_computed() -> None:
    """Prompts no replica holds alternate by the prefill the router sent each replica, not
    by name: a long one counts for as much as it costs."""
    router = PrefixRouter({"a": holding(0), "b": holding(0)})
    long, short = list(range(100, 200)), list(range(300, 310))
    assert router.choose(long, {}) == "a"
    assert router.choose(short, {}) == "b"
    assert router.choose([*range(400, 410)], {}) == "b"  # b computed 10, a 100


def test_a_tier_hit_counts_less_than_one_in_the_pool() -> None:
    """Eight blocks in a host tier (discounted to four) lose to six in a pool."""
    router = PrefixRouter({"tier": holding(8, "host"), "pool": holding(6)})
    assert router.saved_tokens("tier", PROMPT) == 0.5 * 8 * BS
    assert router.choose(PROMPT, {}) == "pool"


def test_replicas_of_one_redis_store_are_credited_with_each_others_blocks() -> None:
    """a stored eight blocks in a Redis store b shares: b may load them (a tier hit,
    discounted); c's Redis is another store. A restarted b shares nothing until it says
    so again."""
    router = PrefixRouter({"a": holding(8, "redis"), "b": holding(0), "c": holding(0)})
    assert router.saved_tokens("b", PROMPT) == 0
    for name, store in (("a", "redis:run1/0/m"), ("b", "redis:run1/0/m"), ("c", "redis:run2/0/m")):
        router.share(name, "REDIS", store)
    assert router.saved_tokens("b", PROMPT) == 0.5 * 8 * BS
    assert router.saved_tokens("c", PROMPT) == 0
    assert router.rank(PROMPT, {}, ["c", "b"])[0] == "b"
    router.set_index("b", holding(0))
    assert router.saved_tokens("b", PROMPT) == 0
    with pytest.raises(ValueError, match="no index for replica 'd'"):
        router.share("d", "REDIS", "redis:run1/0/m")


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


def test_rank_orders_the_candidates_and_sent_remembers_the_one_taken() -> None:
    """A front end tries replicas in rank order and tells the router which took the
    request: only that one is credited with the prompt's blocks."""
    router = PrefixRouter({"a": holding(3), "b": holding(8), "c": holding(0)})
    assert router.rank(PROMPT, {}, ["a", "b", "c"]) == ["b", "a", "c"]
    assert router.rank(PROMPT, {}, ["a", "c"]) == ["a", "c"]  # b out of rotation
    router.sent("a", PROMPT)
    assert router.saved_tokens("a", PROMPT) == 10 * BS
    assert router.saved_tokens("c", PROMPT) == 0
    with pytest.raises(ValueError, match="no index"):
        router.rank(PROMPT, {}, ["d"])


def test_a_prompt_is_hashed_once_though_others_are_ranked_before_it_is_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A front end ranks other requests while one waits for its replica's answer: the
    first's hashes are still the ones ``sent`` takes, not computed again."""
    router = PrefixRouter({"a": holding(3), "b": holding(8)})
    hashed: list[int] = []
    index = router.indexes["a"]
    wire_hashes = index.wire_hashes

    def counted(token_ids: list[int], extra_keys: tuple[object, ...] = ()) -> list[int]:
        hashed.append(len(token_ids))
        return wire_hashes(token_ids, extra_keys)

    monkeypatch.setattr(index, "wire_hashes", counted)
    first, second = list(PROMPT), [*PROMPT[:-1], 60, 61, 62, 63, 64]
    assert router.rank(first, {}, ["a", "b"])[0] == "b"
    router.rank(second, {}, ["a", "b"])
    router.sent("b", first)
    router.sent("a", second)
    assert hashed == [len(first), len(second)]
    assert router.saved_tokens("b", PROMPT) == 10 * BS  # and remembered where it went


def test_a_restarted_replica_starts_from_a_fresh_index() -> None:
    router = PrefixRouter({"a": holding(8), "b": holding(0)})
    router.choose(PROMPT, {})
    router.set_index("a", ReplicaIndex(BS))
    assert router.saved_tokens("a", PROMPT) == 0
    with pytest.raises(ValueError, match="block size 8"):
        router.set_index("a", ReplicaIndex(8))


def test_the_full_attention_only_router_credits_what_the_state_group_cannot_resume() -> None:
    """Replica a holds ten full-attention blocks of the prompt but its Mamba group only
    checkpoints up to block two; b holds six in both. Read from full attention alone, a looks
    better; in every group, b is."""
    hasher = BlockHasher(BS)
    hashes: list[bytes] = []
    hasher.extend(hashes, hasher.root(()), PROMPT, 10 * BS)

    def replica(full: int, state: int) -> ReplicaIndex:
        index = ReplicaIndex(BS)
        stored = [
            BlockStored(
                group=GROUPS[0],
                block_hashes=tuple(hashes[:full]),
                parent_hash=None,
                token_ids=(),
                medium="device",
            ),
            BlockStored(
                group=GROUPS[1],
                block_hashes=tuple(hashes[:state]),
                parent_hash=None,
                token_ids=(),
                medium="device",
                checkpoint_positions=tuple((i + 1) * BS for i in range(state)),
            ),
        ]
        index.apply(0, encode_batch(0.0, stored))
        return index

    indexes = {"a": replica(full=10, state=2), "b": replica(full=6, state=6)}
    assert PrefixRouter(indexes, full_attention_only=True).choose(PROMPT, {}) == "a"
    assert PrefixRouter(indexes).choose(PROMPT, {}) == "b"


def test_the_load_only_baselines() -> None:
    loads = {"a": ReplicaLoad(num_waiting=2), "b": ReplicaLoad(num_running=1)}
    assert LeastLoaded().rank(PROMPT, loads, ["a", "b", "c"]) == ["c", "b", "a"]
    turns = RoundRobin()
    assert [turns.rank(PROMPT, {}, ["b", "a"])[0] for _ in range(3)] == ["a", "b", "a"]
    assert turns.rank(PROMPT, {}, []) == []
