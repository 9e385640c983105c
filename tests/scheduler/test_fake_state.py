"""Mamba-like groups through the engine core with the fake: checkpoints and prefix hits.

The fake checks the state-page contract strictly (``scheduler/fake_state.py``), so these
runs also prove that every page the prefix cache hands out holds its boundary's state.
"""

from __future__ import annotations

import itertools

import pytest

from hybridkv.memory.layout import PoolSpec
from hybridkv.policies import FullAttention, MambaLike
from hybridkv.scheduler import EngineConfig, SamplingParams
from hybridkv.scheduler.batch import StepBatch, StepRequest
from hybridkv.scheduler.core import EngineCore
from hybridkv.scheduler.fake import CollectingSink, FakeExecutor, reference_tokens
from hybridkv.scheduler.fake_state import FakeStateMismatchError

VOCAB = 97
_IDS = itertools.count()


def make_core(block_size: int, num_blocks: int = 400) -> tuple[EngineCore, FakeExecutor]:
    """A Bamba-like pool: three mamba groups and one full-attention group."""
    config = EngineConfig(
        policies=[MambaLike(), MambaLike(), MambaLike(), FullAttention()],
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=2048,
        vocab_size=VOCAB,
        max_num_batched_tokens=48,
    )
    core = EngineCore(config)
    return core, FakeExecutor.for_config(core.config)


def serve(core: EngineCore, fake: FakeExecutor, prompt: list[int], max_tokens: int) -> int:
    """Run one request to its end, its tokens checked against the cache-free reference;
    the prefix-hit tokens it was admitted with."""
    sink = CollectingSink()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    before = core.kv.usage().prefix_hit_tokens
    core.add_request(prompt, params, sink, request_id=f"r{next(_IDS)}")
    while core.has_work:
        plan = core.plan()
        core.apply(plan, fake.execute(plan.batch))
        core.flush()
    tokens = [t for out in sink.items for t in out.new_token_ids]
    assert tokens == reference_tokens(prompt, max_tokens, VOCAB)
    core.kv.check_integrity()
    return core.kv.usage().prefix_hit_tokens - before


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("length", [2, 3, 5])
def test_the_first_repeat_hits_every_full_block_before_the_last_token(
    block_size: int, length: int
) -> None:
    """A prompt of at least two blocks, sent again, resumes from ``(len-1)//bs*bs`` tokens,
    whatever the prefill chunks were."""
    core, fake = make_core(block_size)
    for offset in (0, 1, block_size - 1):
        prompt = [(7 * i + offset) % VOCAB for i in range(length * block_size + offset)]
        serve(core, fake, prompt, 3)
        assert serve(core, fake, prompt, 3) == (len(prompt) - 1) // block_size * block_size


@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_each_chat_turn_hits_the_whole_previous_conversation(block_size: int) -> None:
    """Turn k's prompt is turn k-1's prompt, reply and a new message: it resumes from the
    last block boundary the previous turn's decodes computed."""
    core, fake = make_core(block_size)
    history: list[int] = []
    for turn in range(5):
        prompt = history + [(turn * 13 + i) % VOCAB for i in range(block_size // 2 + 3)]
        hit = serve(core, fake, prompt, block_size + 5)
        computed = len(history) - 1  # the last reply token was never run
        assert hit == max(computed, 0) // block_size * block_size
        history = prompt + reference_tokens(prompt, block_size + 5, VOCAB)


def test_a_read_of_another_boundarys_state_is_refused() -> None:
    """A step resuming after 8 tokens from a page holding the state after 4 fails."""
    _, fake = make_core(4, num_blocks=16)
    params = SamplingParams(max_tokens=1)

    def step(start: int, tokens: list[int], table: list[int]) -> None:
        request = StepRequest(
            request_id="x",
            token_ids=tokens,
            start_position=start,
            # Each state group's own pages: the table's, moved by 4 per group.
            block_tables=[
                *([p + 4 * g if p else 0 for p in table] for g in range(3)),
                [1, 2, 3][: len(table)],
            ],
            sample=False,
            params=params,
            output_index=0,
        )
        fake.execute(StepBatch((request,)))

    step(0, [1] * 6, [4, 5])  # block 0 -> state after 4, block 1 -> running state after 6
    with pytest.raises(FakeStateMismatchError, match="holds the state after 4 tokens"):
        step(8, [1], [0, 4, 6])  # block 1's page is 4, which holds the state after 4


def test_a_kv_page_written_inside_a_state_page_is_caught() -> None:
    """Two page sizes: a state page spans 4 page ids, and a K/V write into one of them
    destroys the state; the fake refuses to read it back."""
    fake = FakeExecutor(PoolSpec([MambaLike(), FullAttention()], 16, 4, state_span=4))
    params = SamplingParams(max_tokens=1)

    def step(start: int, tokens: list[int], tables: list[list[int]]) -> None:
        request = StepRequest(
            request_id="x",
            token_ids=tokens,
            start_position=start,
            block_tables=tables,
            sample=False,
            params=params,
            output_index=0,
        )
        fake.execute(StepBatch((request,)))

    step(0, [1] * 4, [[4], [1]])  # the state after 4 tokens in ids 4-7
    step(0, [2] * 4, [[8], [5]])  # another request's K/V in id 5
    with pytest.raises(FakeStateMismatchError, match=r"state page 4 \(ids 4-7\)"):
        step(4, [1], [[4, 12], [1, 2]])


def test_stats_count_state_pages_apart_from_kv_pages() -> None:
    """With two page sizes, the engine's stats (and so ``/metrics``) count the pages the
    state groups hold apart from the K/V pages, and the spans free for a state page."""
    config = EngineConfig(
        policies=[MambaLike(), FullAttention()],
        num_blocks=40,
        block_size=4,
        max_model_len=64,
        vocab_size=VOCAB,
        state_span=4,
    )
    core = EngineCore(config)
    fake = FakeExecutor.for_config(core.config)
    assert core.stats().num_free_state_pages == 9  # span 0 holds the null page
    core.add_request(
        list(range(10)), SamplingParams(max_tokens=4), CollectingSink(), request_id="a"
    )
    plan = core.plan()
    core.apply(plan, fake.execute(plan.batch))
    stats = core.stats()
    assert stats.num_kv_pages_used == 3  # blocks of 10 tokens and the next one's
    assert stats.num_state_pages_used == 2  # the running state, the last boundary's
    assert stats.num_free_state_pages == 9 - 2
    assert stats.num_free_blocks == 39 - 3 - 2 * 4
