"""Speculative decoding on every architecture: the tokens and logits of transformers.

A proposer that knows transformers' greedy continuation gets a share of it wrong, so
every step verifies a mix of kept and rejected tokens, through chunked prefill, prefix
hits, preemption and decodes; each emitted token and its logits must be transformers'.
The Mamba2 hybrids (Bamba, Granite 4.0-H) must resume every step from the state of the
last kept token, never from a rejected one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest
import torch
from model_fixtures import NEW_FAMILIES, ReferenceModelProposer

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.scheduler import Engine, EngineConfig, SamplingParams
from hybridkv.scheduler.speculation import SpeculativeConfig

SPEC = SpeculativeConfig(
    method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, adaptive=False
)
NUM_TOKENS = 14
#: Bytes of a pool of this many pages of 4 tokens (K/V ones; a state takes a span of
#: them): three requests of about 30 tokens do not fit at once.
POOL_PAGES = {"bamba": 56, "granite_moe": 56, "granite_dense": 56, "qwen3": 36}
POOL_PAGES |= {"qwen3_next": 56, "qwen3_5": 56, "lfm2": 24, "lfm2_moe": 24, "olmo_hybrid": 56}
POOL_PAGES["lfm3"] = 24
POOL_PAGES["jamba"] = 32
POOL_PAGES |= dict.fromkeys(("mamba", "falcon_mamba", "mamba2"), 20)
POOL_PAGES["nemotron_h"] = 64
POOL_PAGES["minimax"] = 24
POOL_PAGES["kimi_linear"] = POOL_PAGES["bailing_hybrid"] = 96
POOL_PAGES["deepseek_v4"] = 64
POOL_PAGES["falcon_h1"] = 40
POOL_PAGES["zamba2"] = 36
POOL_PAGES |= {
    "olmo3": 24,
    "exaone4": 24,
    "cohere2": 24,
    "gpt_oss": 24,
    "llama4": 24,
    "granite_swa": 24,
    "granitemoe_swa": 24,
    "afmoe": 24,
    "mimo_v2_flash": 24,
    "gemma4": 24,
    "gemma4_moe": 24,
}  # a group per layer kind: each holds pages


async def _serve(
    executor: ModelExecutor,
    config: EngineConfig,
    prompts: Sequence[list[int]],
    proposer: Any,
    logits: dict[str, list[torch.Tensor]],
) -> tuple[dict[str, list[int]], Any]:
    outputs: dict[str, list[int]] = {}
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)

    async def one(engine: Engine, i: int) -> None:
        rid = f"r{i}"
        tokens: list[int] = []
        async for out in engine.generate(prompts[i], params, request_id=rid):
            tokens.extend(out.new_token_ids)
        outputs[rid] = tokens

    with anyio.fail_after(120):
        async with Engine(config, executor, proposer=proposer) as engine:
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, engine, i)
            stats = engine.stats()
    return outputs, stats


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "name",
    [
        *("llama", "gemma2", "gemma3", "bamba", "granite_moe", "granite_dense"),
        *("qwen3_next", "qwen3_5", "lfm2", "lfm2_moe", "lfm3", "olmo_hybrid", "jamba"),
        *("mamba", "falcon_mamba", "mamba2", "nemotron_h", "minimax", "falcon_h1"),
        *("zamba2", "kimi_linear", "bailing_hybrid", "deepseek_v4"),
        *NEW_FAMILIES,
    ],
)
async def test_speculated_tokens_and_logits_are_transformers(
    name: str, tiny_models: Any, prompt_of: Any
) -> None:
    model = tiny_models[name]
    logits: dict[str, list[torch.Tensor]] = {}

    def record(request_id: str, row: torch.Tensor) -> None:
        logits.setdefault(request_id, []).append(row.detach().float().clone())

    # A pool too small for all three (preemption), chunks of 8, a shared prefix (hits).
    probe = ModelExecutor.from_pretrained(model.path, LoadOptions(kv_cache_bytes=1 << 20))
    page_bytes = (1 << 20) // probe.pool.num_blocks // 4  # pages of 16 tokens, then of 4
    probe.close()
    executor = ModelExecutor.from_pretrained(
        model.path,
        LoadOptions(kv_cache_bytes=page_bytes * POOL_PAGES.get(name, 18), block_size=4),
        logits_hook=record,
    )
    config = EngineConfig.for_executor(
        executor,
        max_model_len=64,
        max_num_batched_tokens=16,
        max_prefill_chunk=8,
        speculative_config=SPEC,
    )
    shared = prompt_of(12, 1)
    prompts = [shared + prompt_of(5, 2), shared + prompt_of(9, 3), prompt_of(17, 4)]
    proposer = ReferenceModelProposer(model.reference, 256, miss=0.3, seed=7)
    outputs, stats = await _serve(executor, config, prompts, proposer, logits)
    executor.close()
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        got = outputs[rid]
        full = model.reference_logits(prompt + got[:-1])
        expected = full[len(prompt) - 1 :]
        assert got == expected.argmax(-1).tolist()
        # A preempted request is recomputed: its logits were recorded twice from the
        # restart on; the last NUM_TOKENS rows are the ones it kept.
        recorded = torch.stack(logits[rid][-NUM_TOKENS:])
        torch.testing.assert_close(recorded, expected, atol=1e-4, rtol=0)
    spec = stats.spec_decode
    assert spec is not None and 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert stats.prefix_hit_rate > 0
    # The newer families' pools are not sized to preempt here (sliding layers keep a few
    # pages); tests/models/test_model_logits.py recomputes each after a preemption.
    assert stats.num_preemptions > 0 or name in NEW_FAMILIES


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("name", "pp", "tp"),
    [
        ("gemma3", 2, 1),
        ("bamba", 2, 1),
        pytest.param("bamba", 1, 2, marks=pytest.mark.slow),
        pytest.param("granite_moe", 2, 2, marks=pytest.mark.slow),
    ],
)
async def test_pipeline_stages_in_processes_verify_as_one_process(
    name: str, pp: int, tp: int, tiny_models: Any, prompt_of: Any
) -> None:
    """Two stage processes (or two tensor ranks, or 2 x 2), steps in flight: the last
    stage verifies, each stage (each tensor rank its share of the heads) writes its Mamba2
    layers' kept states when the next step brings the verdict, and the tokens and logits
    are transformers'."""
    from hybridkv.parallel.pipeline_executor import PipelineExecutor

    model = tiny_models[name]
    logits: dict[str, list[torch.Tensor]] = {}
    options = LoadOptions(kv_cache_bytes=1 << 19, block_size=4, num_threads=1)
    shared = prompt_of(8, 44)
    prompts = [shared + prompt_of(n, 40 + n) for n in (3, 5)] + [prompt_of(6, 2)]
    proposer = ReferenceModelProposer(model.reference, 256, miss=0.3, seed=3)
    with PipelineExecutor.from_pretrained(
        model.path, options, pipeline_parallel_size=pp, tensor_parallel_size=tp
    ) as pipe:
        pipe.logits_hook = lambda rid, row: logits.setdefault(rid, []).append(row.clone())
        config = EngineConfig.for_executor(pipe, max_model_len=64, speculative_config=SPEC)
        outputs, stats = await _serve(pipe, config, prompts, proposer, logits)  # type: ignore[arg-type]
        assert pipe.peak_steps_in_flight == pp
    for i, prompt in enumerate(prompts):
        got = outputs[f"r{i}"]
        expected = model.reference_logits(prompt + got[:-1])[len(prompt) - 1 :]
        assert got == expected.argmax(-1).tolist()
        torch.testing.assert_close(torch.stack(logits[f"r{i}"]), expected, atol=1e-4, rtol=0)
    assert 0 < stats.spec_decode.num_accepted_tokens < stats.spec_decode.num_draft_tokens


@pytest.mark.asyncio
async def test_ngram_lookup_on_a_real_model_keeps_the_greedy_text(tiny_models: Any) -> None:
    """The engine's own proposer (prompt lookup), no oracle: transformers' greedy text."""
    model = tiny_models["llama"]
    executor = ModelExecutor.from_pretrained(
        model.path, LoadOptions(kv_cache_bytes=1 << 20, block_size=4)
    )
    config = EngineConfig.for_executor(executor, max_model_len=128, speculative_config=SPEC)
    # Random tiny models fall into loops: their own output is what lookup proposes from.
    prompts = [[5, 6, 7, 8] * 4, [9, 1, 9, 2, 9, 3] * 2]
    outputs, stats = await _serve(executor, config, prompts, None, {})
    executor.close()
    for i, prompt in enumerate(prompts):
        got = outputs[f"r{i}"]
        expected = model.reference_logits(prompt + got[:-1])[len(prompt) - 1 :]
        assert got == expected.argmax(-1).tolist()
    assert stats.spec_decode.num_drafts > 0


@pytest.mark.asyncio
@pytest.mark.parametrize("draft", ["llama", "gemma3"])
async def test_a_draft_model_proposes_and_the_text_is_the_targets(
    draft: str, tiny_models: Any, prompt_of: Any
) -> None:
    """A draft checkpoint sharing the vocabulary: itself (every proposal kept) or another
    model (most rejected); either way the target's greedy tokens and logits."""
    from hybridkv.scheduler.draft_proposer import DraftModelProposer

    target = tiny_models["llama"]
    logits: dict[str, list[torch.Tensor]] = {}
    executor = ModelExecutor.from_pretrained(
        target.path,
        LoadOptions(kv_cache_bytes=1 << 20, block_size=4),
        logits_hook=lambda rid, row: logits.setdefault(rid, []).append(row.clone()),
    )
    small = ModelExecutor.from_pretrained(
        tiny_models[draft].path,
        LoadOptions(kv_cache_bytes=1 << 19, block_size=4),
        torch_thread=executor.torch_thread,
    )
    proposer = DraftModelProposer(small, vocab_size=256, max_model_len=128)
    spec = SpeculativeConfig(
        method="draft_model", num_speculative_tokens=3, model="draft", adaptive=False
    )
    config = EngineConfig.for_executor(executor, max_model_len=128, speculative_config=spec)
    prompts = [prompt_of(11, 5), prompt_of(7, 6)]
    outputs, stats = await _serve(executor, config, prompts, proposer, logits)
    executor.close()
    for i, prompt in enumerate(prompts):
        got = outputs[f"r{i}"]
        expected = target.reference_logits(prompt + got[:-1])[len(prompt) - 1 :]
        assert got == expected.argmax(-1).tolist()
        torch.testing.assert_close(torch.stack(logits[f"r{i}"]), expected, atol=1e-4, rtol=0)
    spec_stats = stats.spec_decode
    if draft == "llama":  # the target as its own draft: every proposal is kept
        assert spec_stats.num_accepted_tokens == spec_stats.num_draft_tokens > 0
    else:
        assert spec_stats.num_accepted_tokens < spec_stats.num_draft_tokens
    proposer.kv.check_integrity()
    assert proposer.kv.num_free_blocks == proposer.kv.num_usable_blocks


def test_a_draft_with_another_vocabulary_is_refused(tiny_models: Any) -> None:
    from hybridkv.scheduler.draft_proposer import DraftModelError, DraftModelProposer

    small = ModelExecutor.from_pretrained(
        tiny_models["llama"].path, LoadOptions(kv_cache_bytes=1 << 19)
    )
    with pytest.raises(DraftModelError, match="256 tokens, the target's 300"):
        DraftModelProposer(small, vocab_size=300, max_model_len=64)
    small.close()
