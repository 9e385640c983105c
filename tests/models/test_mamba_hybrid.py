"""The state-mixer hybrids against transformers, float32, with their state in pool pages:
Mamba2 (Bamba, Granite 4.0-H, Nemotron-H, Falcon-H1's beside its attention), Gated
DeltaNet (Qwen3-Next, Qwen3.5, OLMo Hybrid), short convolutions (LFM2, LFM3), Mamba1
(Jamba, Mamba, Falcon-Mamba) and lightning attention (MiniMax).

The tiny Mamba2 hybrids have one attention layer and three Mamba2 layers, SSD chunks of 8
positions; every hybrid runs at blocks of 16 tokens, so prefills cross block boundaries
(and the Mamba2 ones scan chunks), and prefix hits resume from checkpointed states
(``hybridkv.memory.state_pages``).
"""

from __future__ import annotations

import pytest
import torch

from hybridkv.executor.load_options import LoadOptions
from hybridkv.memory.layout import StateSpec
from hybridkv.models.errors import ModelConfigError
from hybridkv.policies import MambaLike

HYBRIDS = ["bamba", "granite_moe", "granite_dense", "qwen3_next", "qwen3_5", "qwen3_5_moe"]
HYBRIDS += ["lfm2", "lfm2_moe", "lfm3", "olmo_hybrid", "jamba", "mamba", "falcon_mamba", "mamba2"]
HYBRIDS += ["nemotron_h", "minimax", "falcon_h1", "falcon_h1_gate_only", "zamba2", "kimi_linear"]
HYBRIDS += ["bailing_hybrid", "deepseek_v4"]
BS = 16


@pytest.mark.parametrize("name", HYBRIDS)
def test_prefill_across_scan_chunks_then_decodes_match(
    name, tiny_models, make_driver, prompt_of, check_reference
):
    """A 45-token prompt in one step (six SSD chunks, three blocks), then 8 decodes."""
    driver = make_driver(name, block_size=BS)
    assert driver.executor.plan.block_size == BS
    driver.add("a", prompt_of(45, 1))
    driver.run(8)
    check_reference(tiny_models[name], driver, "a")


@pytest.mark.parametrize("name", HYBRIDS)
def test_batched_chunked_prefills_mixed_with_decodes_match(
    name, tiny_models, make_driver, prompt_of, check_reference
):
    """Requests of 3, 20 and 50 tokens prefilled 7 at a time while the short ones decode."""
    driver = make_driver(name, block_size=BS)
    for i, length in enumerate((3, 20, 50)):
        driver.add(f"r{i}", prompt_of(length, 10 + i))
    driver.run(12, chunk=7)
    for i in range(3):
        check_reference(tiny_models[name], driver, f"r{i}")


@pytest.mark.parametrize("name", HYBRIDS)
@pytest.mark.parametrize("length", [33, 47, 48, 49])
def test_first_repeat_hits_every_full_block_but_the_last_token(
    name, length, tiny_models, make_driver, prompt_of, check_reference
):
    """The same prompt again resumes from ``(len - 1) // bs * bs`` tokens and matches."""
    driver = make_driver(name, block_size=BS)
    prompt = prompt_of(length, 3)
    driver.add("first", prompt)
    driver.run(2, chunk=13)
    again = driver.add("again", prompt)
    driver.run(4)
    assert again.hit_tokens == (length - 1) // BS * BS
    check_reference(tiny_models[name], driver, "again")


@pytest.mark.parametrize("name", HYBRIDS)
def test_next_chat_turn_resumes_where_the_decodes_ended(
    name, tiny_models, make_driver, prompt_of, check_reference
):
    """A turn whose prompt is the previous turn's prompt and reply hits the boundaries the
    decodes crossed, not only the prompt's."""
    driver = make_driver(name, block_size=BS)
    turn = driver.add("turn1", prompt_of(20, 4))
    driver.run(30)
    history = turn.prompt + turn.output
    nxt = driver.add("turn2", history + prompt_of(5, 5))
    driver.run(31)
    computed = len(history) - 1  # the last reply token was sampled, never run
    assert nxt.hit_tokens == computed // BS * BS == 48
    check_reference(tiny_models[name], driver, "turn2")


@pytest.mark.parametrize("name", HYBRIDS)
def test_recompute_after_preemption_matches(
    name, tiny_models, make_driver, prompt_of, check_reference
):
    """A request preempted mid-decode resumes from its own checkpoints and matches."""
    driver = make_driver(name, block_size=BS)
    driver.add("a", prompt_of(30, 6))
    driver.add("b", prompt_of(9, 7))
    driver.run(6, chunk=11)
    driver.preempt("a")
    driver.run(12, chunk=11)
    assert driver.active["a"].hit_tokens == BS * 2
    for rid in ("a", "b"):
        check_reference(tiny_models[name], driver, rid)


def test_state_layers_view_pool_pages_as_float32(make_driver) -> None:
    """Each Mamba2 layer's cache is a float32 row per page, holding conv and SSM state."""
    executor = make_driver("bamba", block_size=BS).executor
    config = executor.config
    assert config.mamba is not None
    for spec, cache in zip(executor.specs, executor.kv_caches, strict=True):
        if isinstance(spec, StateSpec):
            assert cache.dtype == torch.float32
            assert cache.shape == (executor.plan.num_blocks, config.mamba.state_values)
            assert spec.state_bytes == 4 * config.mamba.state_values == 3200


@pytest.mark.parametrize("name", ["bamba", "granite_moe"])
def test_a_larger_state_takes_a_span_of_pages_and_keeps_the_block_size(
    name, tiny_models, make_driver, prompt_of, check_reference
) -> None:
    """Asked for blocks of 4 tokens, the planner keeps 4 and gives a state a span of K/V
    pages; a chunked prefill, decodes across blocks, a repeat's hit and a preempted
    request's recompute match transformers."""
    driver = make_driver(name, block_size=4)
    plan = driver.executor.plan
    assert plan.block_size == 4 and plan.state_span > 1
    prompt = prompt_of(29, 3)
    driver.add("a", prompt)
    driver.add("c", prompt_of(17, 5))
    driver.run(3, chunk=11)
    driver.preempt("c")
    driver.run(9, chunk=11)
    check_reference(tiny_models[name], driver, "a")
    again = driver.add("b", prompt)
    driver.run(3)
    assert again.hit_tokens == 28  # (29 - 1) // 4 * 4
    check_reference(tiny_models[name], driver, "b")
    check_reference(tiny_models[name], driver, "c")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"layer_types": ["mamba", "conv", "mamba", "mamba"]}, "layer type 'conv'"),
        ({"position_embedding_type": "alibi"}, "'position_embedding_type'"),
        ({"mamba_n_heads": 3}, "mamba_n_heads=3"),
    ],
)
def test_bad_granite_configs_are_refused(tiny_models, fields, message) -> None:
    """A config the model cannot honour fails naming the field."""
    import json

    from hybridkv.models.families.granite_hybrid import parse_granite_hybrid

    hf = json.loads((tiny_models["granite_dense"].path / "config.json").read_text())
    with pytest.raises(ModelConfigError, match=message):
        parse_granite_hybrid({**hf, **fields})


@pytest.mark.parametrize("name", ["bamba", "granite_moe"])
@pytest.mark.parametrize(("every", "hit"), [(1, 32), (None, 0)])
def test_a_shared_prefix_hits_inside_a_prompt_only_with_inner_checkpoints(
    name, every, hit, tiny_models, make_driver, prompt_of, check_reference
):
    """A prompt sharing the first 40 tokens of a 70-token prompt prefilled at once resumes
    from 32 with ``MambaLike(checkpoint_every=1)`` chosen for the mamba kind; by default a
    prefill keeps only its last boundaries' states, so it finds none and recomputes."""
    policies = {"mamba": MambaLike(checkpoint_every=every)}
    driver = make_driver(name, block_size=BS, policies=policies)
    shared = prompt_of(40, 8)
    driver.add("first", shared + prompt_of(30, 9))
    driver.run(2)
    second = driver.add("second", shared + prompt_of(9, 10))
    driver.run(3)
    assert second.hit_tokens == hit
    check_reference(tiny_models[name], driver, "second")


@pytest.mark.asyncio
@pytest.mark.parametrize("name", ["bamba", "granite_moe"])
async def test_engine_outputs_match_transformers_under_preemption(
    name, tiny_models, prompt_of, serve_all
):
    """Three concurrent greedy requests through the async Engine, in a pool of 20 pages
    too small for all of them, give transformers' greedy tokens."""
    from hybridkv.executor.model_executor import ModelExecutor
    from hybridkv.scheduler import EngineConfig, SamplingParams

    model = tiny_models[name]
    executor = ModelExecutor.from_pretrained(
        model.path, LoadOptions(kv_cache_bytes=20 * 4096, block_size=BS)
    )
    config = EngineConfig.for_executor(
        executor, max_model_len=128, max_num_batched_tokens=24, max_prefill_chunk=8
    )
    prompts = [prompt_of(n, 40 + n) for n in (21, 30, 37)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs, stats = await serve_all(executor, config, prompts, params)
    assert stats.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = model.reference.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0
            )
        assert outputs[i] == out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "name",
    [
        *("bamba", "granite_moe", "qwen3_next", "lfm2", "lfm3", "olmo_hybrid", "jamba"),
        *("mamba2", "nemotron_h", "minimax", "falcon_h1", "kimi_linear", "bailing_hybrid"),
    ],
)
def test_pipeline_stages_hold_their_state_pages_and_match_transformers(
    name, tiny_models, drive, chain, prompt_of, check_reference
):
    """Two stages chained in one process (Mamba2 and attention layers split between them,
    each holding only its layers' pages) give transformers' logits, through chunked
    prefill, a prefix hit on a checkpoint and decodes."""
    from hybridkv.executor.model_executor import ModelExecutor

    stages = [
        ModelExecutor.from_pretrained(
            tiny_models[name].path,
            LoadOptions(kv_cache_bytes=1 << 20, block_size=BS),
            pipeline_stage=i,
            pipeline_parallel_size=2,
        )
        for i in range(2)
    ]
    driver = drive(chain(stages))
    prompt = prompt_of(40, 11)
    driver.add("first", prompt)
    driver.run(3, chunk=13)
    again = driver.add("again", prompt)
    driver.run(5, chunk=13)
    assert again.hit_tokens == 32
    check_reference(tiny_models[name], driver, "first")
    check_reference(tiny_models[name], driver, "again")


def test_bfloat16_models_keep_their_state_in_float32(tiny_models, make_driver, prompt_of):
    """A bfloat16 model's state pages are float32 (its K/V pages bfloat16); its logits stay
    within bfloat16 rounding (0.1, logits of about 2) of the float32 reference."""
    driver = make_driver("bamba", block_size=BS, dtype=torch.bfloat16)
    executor = driver.executor
    dtypes = {
        type(spec).__name__: cache.dtype
        for spec, cache in zip(executor.specs, executor.kv_caches, strict=True)
    }
    assert dtypes == {"StateSpec": torch.float32, "AttentionSpec": torch.bfloat16}
    driver.add("a", prompt_of(37, 12))
    driver.run(5, chunk=13)
    seq = driver.active["a"]
    expected = tiny_models["bamba"].reference_logits(seq.prompt + seq.output[:-1])
    got = torch.stack(driver.logits["a"])
    torch.testing.assert_close(got, expected[len(seq.prompt) - 1 :], atol=0.1, rtol=0)


@pytest.mark.parametrize("name", ["bamba", "granite_moe"])
def test_a_shared_prefix_resumes_from_where_prompts_diverged_and_from_doubling_checkpoints(
    name, tiny_models, make_driver, prompt_of, check_reference
):
    """At blocks of 4 tokens (a state spans several K/V pages), with the default policy:
    a prompt sharing 40 tokens of one prefilled at once finds no state there and
    recomputes, but keeps one where it left the shared part, so the next prompt sharing
    it resumes at 40; a prompt sharing 70 tokens of an 84-token one resumes at the
    checkpoint its prefill kept after 16 blocks (64 tokens). All match transformers."""
    driver = make_driver(name, block_size=4)
    assert driver.executor.plan.state_span > 1
    shared = prompt_of(40, 11)
    driver.add("first", shared + prompt_of(30, 12))
    driver.run(2)
    second = driver.add("second", shared + prompt_of(9, 13))
    driver.run(2)
    third = driver.add("third", shared + prompt_of(12, 14))
    driver.run(3)
    assert (second.hit_tokens, third.hit_tokens) == (0, 40)
    long = prompt_of(84, 15)
    driver.add("long", long)
    driver.run(2)
    near = driver.add("near", long[:70] + prompt_of(6, 16))
    driver.run(3)
    assert near.hit_tokens == 64
    for rid in ("second", "third", "long", "near"):
        check_reference(tiny_models[name], driver, rid)
