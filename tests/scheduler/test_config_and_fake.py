"""Engine config validation, and the fake executor's cache-faithful determinism."""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.memory.layout import KVGroup, LayoutPlan, PoolSpec
from hybridkv.policies import FullAttention, SlidingWindow
from hybridkv.scheduler import ConfigError, EngineConfig, StepBatch, StepRequest
from hybridkv.scheduler.fake import FakeExecutor, FakeKVMismatchError, reference_tokens
from hybridkv.scheduler.params import SamplingParams

BASE: dict[str, Any] = {
    "policies": [FullAttention()],
    "num_blocks": 64,
    "block_size": 4,
    "max_model_len": 128,
}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("policies", []),
        ("policies", ["full"]),
        ("num_blocks", 1),
        ("block_size", 0),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", -1),
        ("max_prefill_chunk", 0),
        ("min_prefill_chunk", 0),
        ("max_waiting", 0),
        ("max_model_len", True),
    ],
)
def test_config_rejects_out_of_range_values(field: str, value: object) -> None:
    """Every field is validated, and the message names the field and the value."""
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**{**BASE, field: value})


def test_config_for_an_executor_takes_its_layout_plans_pool() -> None:
    """A layout plan's pool is its groups' policies, block count and block size, and
    ``for_executor`` copies it from the executor that holds the plan."""
    groups = (
        KVGroup(group_id=0, policy=FullAttention(), layer_names=("l0",)),
        KVGroup(group_id=1, policy=SlidingWindow(window=32), layer_names=("l1",)),
    )
    plan = LayoutPlan(
        block_size=16,
        num_blocks=321,
        block_bytes=4096,
        groups=groups,
        group_size=1,
        layer_slots={"l0": (0, 0), "l1": (1, 0)},
        budget_bytes=321 * 4096,
        padding_bytes=0,
        uniform_num_blocks=321,
    )
    config = EngineConfig.for_executor(
        FakeExecutor(plan.pool), max_model_len=2048, eos_token_ids=[2]
    )
    assert config.policies == (FullAttention(), SlidingWindow(window=32))
    assert (config.num_blocks, config.block_size, config.max_model_len) == (321, 16, 2048)
    assert config.eos_token_ids == frozenset({2})


def item(start: int, tokens: list[int], tables: list[list[int]], sample: bool) -> StepRequest:
    return StepRequest(
        request_id="a",
        token_ids=tokens,
        start_position=start,
        block_tables=tables,
        sample=sample,
        params=SamplingParams(),
        output_index=0,
    )


def test_fake_executor_samples_the_reference_through_chunks_and_pages() -> None:
    """Chunked through scattered pages, the fake samples what the uncached reference does."""
    fake = FakeExecutor(PoolSpec((FullAttention(),) * 2, 16, 4), vocab_size=97)
    prompt = list(range(10))
    tables = [[5, 9, 2], [7, 3, 11]]
    assert fake.sample(StepBatch((item(0, prompt[:6], tables, False),))) == [None]
    (token,) = fake.sample(StepBatch((item(6, prompt[6:], tables, True),)))
    assert token == reference_tokens(prompt, 1, 97)[0]


def test_fake_executor_detects_a_wrong_block_table() -> None:
    """Reading a position from pages the groups disagree on raises FakeKVMismatchError."""
    fake = FakeExecutor(PoolSpec((FullAttention(),) * 2, 16, 4))
    fake.sample(StepBatch((item(0, [1, 2, 3, 4, 5], [[1, 2], [3, 4]], False),)))
    with pytest.raises(FakeKVMismatchError, match="position 4"):
        fake.sample(StepBatch((item(5, [6], [[1, 2], [3, 5]], True),)))
