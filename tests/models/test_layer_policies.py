"""A user's memory policy chosen per layer kind runs on a real model, as transformers would.

The policy is README's StreamingLLM sink + window, written here by subclassing
``MemoryPolicy`` only. transformers runs the same checkpoint with the equivalent 4D
attention mask (eager attention): for Gemma 3 one mask per layer type, the sliding layers
keeping their window and only the full layers getting the sink window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import attrs
import pytest
import torch

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.memory.layout_planner import plan_layout
from hybridkv.models.errors import ModelConfigError
from hybridkv.policies import FullAttention, MemoryPolicy, PolicyError, SlidingWindow, Span
from hybridkv.policies.base import positive

WINDOW = 8  # the sliding window of the tiny Gemma 3 (tests/model_fixtures.py)


@attrs.frozen
class SinkWindow(MemoryPolicy):
    """Keep the first ``sinks`` tokens and the last ``window`` tokens (StreamingLLM)."""

    name: ClassVar[str] = "sink_window"
    sinks: int = attrs.field(validator=positive)
    window: int = attrs.field(validator=positive)

    def live_spans(self, num_tokens: int) -> tuple[Span, ...]:
        start = max(0, num_tokens - self.window + 1)
        if start <= self.sinks:
            return ((0, num_tokens),) if num_tokens else ()
        return ((0, self.sinks), (start, num_tokens))


SINKS = SinkWindow(sinks=4, window=WINDOW)
CHOICE = {"full_attention": SINKS}


def additive_mask(policy: MemoryPolicy, length: int) -> torch.Tensor:
    """``[1, 1, length, length]``: 0 where query p reads key k (live at p, or p), else -inf."""
    allowed = torch.zeros(length, length, dtype=torch.bool)
    for p in range(length):
        for start, end in policy.live_spans(p):
            allowed[p, start:end] = True
        allowed[p, p] = True
    mask = torch.zeros(length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return mask[None, None]


def reference_logits(model, token_ids: Sequence[int]) -> torch.Tensor:
    """transformers' logits with full-attention layers attending as SINKS says."""
    n = len(token_ids)
    full = additive_mask(SINKS, n)
    mask: torch.Tensor | dict[str, torch.Tensor] = full
    if model.name == "gemma3":
        sliding = additive_mask(SlidingWindow(WINDOW), n)
        mask = {"full_attention": full, "sliding_attention": sliding}
    with torch.no_grad():
        out = model.reference(input_ids=torch.tensor([list(token_ids)]), attention_mask=mask)
    return out.logits[0].float()


def check_reference(model, driver, request_id: str) -> None:
    """Every sampled step's logits within 1e-4 of the masked reference, same greedy tokens."""
    seq = driver.active[request_id]
    recorded = torch.stack(driver.logits[request_id])
    expected = reference_logits(model, seq.prompt + seq.output[:-1])[len(seq.prompt) - 1 :]
    torch.testing.assert_close(recorded, expected, atol=1e-4, rtol=0)
    assert seq.output == expected.argmax(-1).tolist()


def sink_table(driver, request_id: str) -> list[int]:
    """The request's block table in the sink + window group."""
    (group,) = [g.group_id for g in driver.executor.plan.groups if g.policy == SINKS]
    return list(driver.kv.block_tables(request_id)[group])


ARCHS = ["llama", "gemma3"]


@pytest.mark.parametrize("name", ARCHS)
def test_decode_past_the_window_matches_transformers(name, tiny_models, make_driver, prompt_of):
    """A prompt of 3 windows and 12 decodes attend sinks + window, middle pages released."""
    driver = make_driver(name, policies=CHOICE)
    driver.add("a", prompt_of(23, 1))
    driver.run(12)
    table = sink_table(driver, "a")
    assert table[0] != 0 and 0 in table[1:-2]  # the sink page kept, middle pages null
    check_reference(tiny_models[name], driver, "a")


@pytest.mark.parametrize("name", ARCHS)
def test_chunked_prefill_matches_transformers(name, tiny_models, make_driver, prompt_of):
    """Prompts prefilled 7 tokens a step beside a decoding request each match."""
    driver = make_driver(name, policies=CHOICE)
    driver.add("a", prompt_of(31, 2))
    driver.add("b", prompt_of(12, 3))
    driver.run(5, chunk=7)
    check_reference(tiny_models[name], driver, "a")
    check_reference(tiny_models[name], driver, "b")


@pytest.mark.parametrize("name", ARCHS)
def test_prefix_hit_matches_transformers(name, tiny_models, make_driver, prompt_of):
    """A request resuming from cached sink and window pages matches the reference."""
    driver = make_driver(name, policies=CHOICE)
    shared = prompt_of(26, 4)
    driver.add("first", shared + prompt_of(3, 5))
    driver.run(3)
    second = driver.add("second", shared + prompt_of(6, 6))
    driver.run(4)
    assert second.hit_tokens >= 24
    check_reference(tiny_models[name], driver, "second")


def test_planner_groups_layers_by_the_chosen_policy(make_driver):
    """Gemma 3's full layers form sink + window groups; its sliding layers keep theirs."""
    executor = make_driver("gemma3", policies=CHOICE).executor
    assert set(executor.plan.policies) == {SINKS, SlidingWindow(WINDOW)}
    sinks = [s.name for s in executor.config.layers if s.policy == SINKS]
    assert sinks == ["model.layers.2.self_attn", "model.layers.5.self_attn"]


def test_uniform_layout_keeps_everything_and_attends_by_the_choice(
    tiny_models, make_driver, prompt_of
):
    """uniform_layout stores every layer as full attention; the choice still sets the mask."""
    driver = make_driver("llama", policies=CHOICE, uniform_layout=True)
    assert set(driver.executor.plan.policies) == {FullAttention()}
    driver.add("a", prompt_of(21, 8))
    driver.run(6)
    check_reference(tiny_models["llama"], driver, "a")


@pytest.mark.parametrize(
    ("policies", "error", "message"),
    [
        ({"sliding_attention": SINKS}, ModelConfigError, r"'sliding_attention'.*full_attention"),
        ({"full": SINKS}, ModelConfigError, r"layer kind 'full'"),
        ({"full_attention": "sink_window"}, PolicyError, r"'full_attention' is 'sink_window'"),
    ],
)
def test_bad_choice_is_refused_by_name(tiny_models, policies, error, message):
    """A kind the model lacks, or a value that is not a policy, is refused naming it."""
    with pytest.raises(error, match=message):
        ModelExecutor.from_pretrained(
            tiny_models["llama"].path, LoadOptions(kv_cache_bytes=1 << 20, policies=policies)
        )


def test_plan_keeping_less_than_a_layer_attends_is_refused(make_driver):
    """An executor refuses a layout whose groups release keys its layers read."""
    executor = make_driver("llama").executor
    narrow = [attrs.evolve(s, policy=SlidingWindow(WINDOW)) for s in executor.config.layers]
    plan = plan_layout(narrow, 1 << 20, 4)
    with pytest.raises(ModelConfigError, match=r"layers\.0.*keeps SlidingWindow"):
        ModelExecutor(executor.model, plan, device=torch.device("cpu"))
