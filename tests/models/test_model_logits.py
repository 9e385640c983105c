"""Logits and greedy tokens of every architecture against transformers, float32.

Prompts are longer than the sliding window (8 tokens, blocks of 4), so sliding layers
really drop pages and the paged attention must mask by window, not by table.
"""

from __future__ import annotations

import pytest
from model_fixtures import ATTENTION

ARCHS = ATTENTION


@pytest.mark.parametrize("name", ARCHS)
def test_single_request_matches_transformers(
    name, tiny_models, make_driver, prompt_of, check_reference
):
    """A prompt of 3 windows then 6 decode steps match the reference at every step."""
    driver = make_driver(name)
    driver.add("a", prompt_of(23, 1))
    driver.run(6)
    check_reference(tiny_models[name], driver, "a")


@pytest.mark.parametrize("name", ARCHS)
def test_batched_requests_match_transformers(
    name, tiny_models, make_driver, prompt_of, check_reference
):
    """Three requests of different lengths sharing every step each match the reference."""
    driver = make_driver(name)
    for i, length in enumerate((5, 19, 30)):
        driver.add(f"r{i}", prompt_of(length, 10 + i))
    driver.run(5)
    for i in range(3):
        check_reference(tiny_models[name], driver, f"r{i}")


@pytest.mark.parametrize("name", ARCHS)
def test_chunked_prefill_matches_transformers(
    name, tiny_models, make_driver, prompt_of, check_reference
):
    """A prompt prefilled 7 tokens a step (chunks not aligned to blocks) matches."""
    driver = make_driver(name)
    driver.add("a", prompt_of(31, 2))
    driver.add("b", prompt_of(12, 3))
    driver.run(4, chunk=7)
    check_reference(tiny_models[name], driver, "a")
    check_reference(tiny_models[name], driver, "b")


@pytest.mark.parametrize("name", ARCHS)
def test_prefix_hit_matches_transformers(
    name, tiny_models, make_driver, prompt_of, check_reference
):
    """A second request resuming from the first one's cached pages matches the reference."""
    driver = make_driver(name)
    shared = prompt_of(26, 4)
    driver.add("first", shared + prompt_of(3, 5))
    driver.run(3)
    second = driver.add("second", shared + prompt_of(6, 6))
    driver.run(3)
    assert second.hit_tokens >= 24
    check_reference(tiny_models[name], driver, "second")


@pytest.mark.parametrize("name", ARCHS)
def test_recompute_after_preemption_matches(
    name, tiny_models, make_driver, prompt_of, check_reference
):
    """A request preempted mid-decode and recomputed gives the same tokens and logits."""
    driver = make_driver(name, prefix_caching=False)
    seq = driver.add("a", prompt_of(18, 7))
    driver.run(3)
    driver.preempt("a")
    driver.run(7, chunk=5)
    assert seq.hit_tokens == 0
    check_reference(tiny_models[name], driver, "a")
