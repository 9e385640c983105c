"""A router's index, rebuilt from a replica's KV events alone, answers what the replica's
own prefix lookup finds, in every group, and counts what a full-attention-only index
would overstate."""

from __future__ import annotations

import attrs
import hypothesis.strategies as st
from hypothesis import given, settings

from hybridkv.memory.cache_events import BlockRemoved, BlockStored, GroupInfo
from hybridkv.memory.hashing import BlockHasher
from hybridkv.parallel.kv_event_wire import encode_batch
from hybridkv.policies import FullAttention, MambaLike, SlidingWindow
from hybridkv.serving.router.index import ReplicaIndex, policy_of
from tests.parallel.test_kv_events import BS, Recorder, make_core, prompts, run


@attrs.frozen
class Probe:
    """A request the lookup reads: its tokens, no cache salt."""

    request_id: str
    all_token_ids: list[int]
    extra_keys: tuple[object, ...] = ()


@settings(max_examples=15, deadline=None)
@given(
    prompts=prompts,
    max_tokens=st.integers(1, 6),
    probes=st.lists(st.lists(st.integers(0, 5), max_size=20), min_size=1, max_size=8),
)
def test_the_index_resumes_what_the_engine_s_lookup_finds(
    prompts: list[list[int]], max_tokens: int, probes: list[list[int]]
) -> None:
    """After random requests with eviction (full, window and mamba groups), for the
    prompts served and random sequences sharing their start, the index's resumable
    length equals the engine's own lookup."""
    recorder = Recorder()
    core, fake, _ = make_core(recorder)
    try:
        run(core, fake, prompts * 2, max_tokens)
    finally:
        fake.close()
    index = ReplicaIndex(BS)
    for seq, payload in enumerate(recorder.payloads):
        index.apply(seq, payload)
    candidates = prompts + [[7, 8, 9, 10, 11, *probe] for probe in probes]
    for tokens in candidates:
        expected = core.kv.lookup(Probe("probe", tokens)).num_tokens
        assert index.resumable(tokens) == expected, tokens


def _stored(group: GroupInfo, hashes: list[bytes], blocks: range) -> BlockStored:
    return BlockStored(
        group=group,
        block_hashes=tuple(hashes[i] for i in blocks),
        parent_hash=hashes[blocks.start - 1] if blocks.start else None,
        token_ids=(),
        medium="device",
        checkpoint_positions=tuple((i + 1) * BS for i in blocks) if group.keeps_state else None,
    )


def test_a_full_attention_only_index_overstates_what_a_hybrid_resumes() -> None:
    """Full attention and the window group hold blocks 0-4 of a prompt, the mamba group
    a checkpoint at the end of block 1 only: the replica resumes 2 blocks (the state
    exists nowhere later), where an index of full attention alone says 5; without the
    window group's first blocks, nothing."""
    tokens = list(range(1, 23))
    hasher = BlockHasher(BS)
    hashes: list[bytes] = []
    hasher.extend(hashes, hasher.root(()), tokens, 20)
    full, window, mamba = (
        GroupInfo.of(i, policy, BS)
        for i, policy in enumerate([FullAttention(), SlidingWindow(window=6), MambaLike()])
    )
    events = [
        _stored(full, hashes, range(5)),
        _stored(window, hashes, range(5)),
        _stored(mamba, hashes, range(1, 2)),
    ]
    hybrid, full_only = ReplicaIndex(BS), ReplicaIndex(BS)
    hybrid.apply(0, encode_batch(0.0, events))
    full_only.apply(0, encode_batch(0.0, events[:1]))
    assert hybrid.resumable(tokens) == 2 * BS
    assert full_only.resumable(tokens) == 5 * BS
    # The checkpoint at block 4's end arrives: now every group resumes 5 blocks.
    hybrid.apply(1, encode_batch(0.0, [_stored(mamba, hashes, range(4, 5))]))
    assert hybrid.resumable(tokens) == 5 * BS
    # The window group loses blocks 0 and 1: at 5 it still reads 3-4, at 2 it cannot.
    gone = BlockRemoved(group=window, block_hashes=tuple(hashes[:2]), medium="device")
    hybrid.apply(2, encode_batch(0.0, [gone]))
    assert hybrid.resumable(tokens) == 5 * BS
    hybrid.apply(
        3,
        encode_batch(0.0, [BlockRemoved(group=mamba, block_hashes=(hashes[4],), medium="device")]),
    )
    assert hybrid.resumable(tokens) == 0


def test_groups_are_rebuilt_from_their_kind_and_window() -> None:
    assert policy_of("full_attention", None) == FullAttention()
    assert policy_of("sliding_window", 6) == SlidingWindow(window=6)
    assert policy_of("mamba", None) == MambaLike()
    assert policy_of("chunked_local_attention", None) == FullAttention()  # never overstates
