"""The executor: layout from the config, batch checks, sampling through a real model."""

from __future__ import annotations

import pytest

from hybridkv.executor.errors import BatchError
from hybridkv.policies.builtin import FullAttention, SlidingWindow
from hybridkv.scheduler.batch import StepBatch, StepRequest, StepResult
from hybridkv.scheduler.params import SamplingParams

SEEDED = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=4321, max_tokens=64)


def _request(**overrides):
    fields = {
        "request_id": "r",
        "token_ids": [5, 6, 7],
        "start_position": 0,
        "block_tables": [[1], [2], [3]],
        "sample": True,
        "params": SamplingParams(temperature=0.0),
        "output_index": 0,
    }
    return StepRequest(**{**fields, **overrides})


def test_gemma3_gets_full_and_sliding_groups_from_its_config(make_driver):
    """Gemma 3's layer_types give full and sliding-window groups with no user setting."""
    plan = make_driver("gemma3").executor.plan
    assert set(plan.policies) == {FullAttention(), SlidingWindow(8)}
    assert sum(len(g.layer_names) for g in plan.groups) == 6


def test_uniform_layout_puts_every_layer_in_full_groups(make_driver):
    """uniform_layout=True plans every layer as full attention (the baseline)."""
    plan = make_driver("gemma3", uniform_layout=True).executor.plan
    assert set(plan.policies) == {FullAttention()}


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_uniform_layout_gives_the_same_logits(
    name, tiny_models, make_driver, prompt_of, check_reference
):
    """With every layer kept in full, sliding layers still attend only to their window."""
    driver = make_driver(name, uniform_layout=True)
    driver.add("a", prompt_of(21, 8))
    driver.run(4)
    check_reference(tiny_models[name], driver, "a")


def test_seeded_sampling_ignores_batch_neighbours(make_driver, prompt_of):
    """A seeded request samples the same tokens alone and batched with other requests."""
    alone = make_driver("gemma3")
    alone.add("s", prompt_of(13, 20), SEEDED)
    alone.run(8)
    mixed = make_driver("gemma3", seed=99)
    mixed.add("x", prompt_of(9, 21), SamplingParams(temperature=1.0, max_tokens=64))
    mixed.add("s", prompt_of(13, 20), SEEDED)
    mixed.run(8, chunk=5)
    assert alone.active["s"].output == mixed.active["s"].output


def test_seeded_sampling_survives_preemption(make_driver, prompt_of):
    """A seeded request recomputed after preemption continues with the same tokens."""
    straight = make_driver("gemma2")
    straight.add("s", prompt_of(15, 22), SEEDED)
    straight.run(8)
    interrupted = make_driver("gemma2", prefix_caching=False)
    interrupted.add("s", prompt_of(15, 22), SEEDED)
    interrupted.run(3)
    interrupted.preempt("s")
    interrupted.run(8)
    assert straight.active["s"].output == interrupted.active["s"].output


def test_empty_batch_returns_nothing(make_driver):
    """A step with no request runs nothing."""
    assert make_driver("gemma3").executor.execute(StepBatch(())) == StepResult(token_ids=())


def test_unsampled_chunk_returns_none(make_driver):
    """A prefill chunk that is not the prompt's last returns None for its request."""
    executor = make_driver("gemma3").executor
    result = executor.execute(StepBatch((_request(sample=False),)))
    assert result == StepResult(token_ids=(None,))


def test_wrong_number_of_block_tables_is_refused(make_driver):
    """A request must bring one block table per KV group."""
    executor = make_driver("gemma3").executor
    with pytest.raises(BatchError, match="1 block tables, the layout has 3"):
        executor.execute(StepBatch((_request(block_tables=[[1]]),)))


def test_short_block_table_is_refused(make_driver):
    """A table must cover every position the step writes."""
    executor = make_driver("gemma3").executor
    request = _request(token_ids=[1] * 9, block_tables=[[1, 2], [3, 4], [5, 6]])
    with pytest.raises(BatchError, match="9 tokens need 3"):
        executor.execute(StepBatch((request,)))


def test_sequence_past_max_model_len_is_refused(make_driver):
    """A request may not run past the model's maximum position."""
    executor = make_driver("llama").executor
    request = _request(start_position=510, block_tables=[[1] * 200])
    with pytest.raises(BatchError, match="max_model_len=512"):
        executor.execute(StepBatch((request,)))


def test_min_tokens_withholds_eos_through_the_executor(make_driver, prompt_of):
    """Under min_tokens the executor never samples an end token, even greedily."""
    driver = make_driver("gemma3")
    free = driver.add("free", prompt_of(10, 40))
    driver.run(1)
    eos = free.output[0]
    driver.executor.sampler.eos_token_ids = (eos,)
    held = driver.add("held", prompt_of(10, 40), SamplingParams(temperature=0.0, min_tokens=2))
    driver.run(2)
    assert held.output[0] != eos
