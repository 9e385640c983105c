"""Context parallelism in gloo processes: the same tokens, and logits within 1e-5, as one
process, through chunked prefill over cached context, prefix hits, preemption and decode."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.models.errors import ParallelConfigError
from hybridkv.parallel.context_executor import ContextParallelExecutor
from hybridkv.parallel.context_group import ContextRanks
from hybridkv.parallel.pipeline_executor import PipelineExecutor
from hybridkv.policies.builtin import ChunkedLocal
from hybridkv.scheduler import SamplingParams
from hybridkv.scheduler.batch import StepBatch, StepRequest

KV_BYTES = 1 << 20


def _context(path: Path, cp: int, *, block_size: int = 4, **options) -> PipelineExecutor:
    options.setdefault("pipeline_parallel_size", 1)
    load = LoadOptions(kv_cache_bytes=KV_BYTES, block_size=block_size, num_threads=1)
    return PipelineExecutor.from_pretrained(
        path, load, context_parallel_size=cp, step_timeout_s=60.0, **options
    )


def test_two_ranks_match_one_process_llama(
    tiny_models, make_driver, drive, run_scenario, check_same_outputs
) -> None:
    """Llama on cp = 2: prompts of 31, 18 and 32 tokens in chunks of 7 (not multiples of cp,
    later chunks over cached context), a prefix hit, a preemption, then decodes."""
    expected = run_scenario(make_driver("llama"))
    with _context(tiny_models["llama"].path, 2) as executor:
        assert executor.pool.block_size == 8  # virtual blocks of block_size x cp
        got = run_scenario(drive(executor))
        counters = executor.stage0.ranks.counters
    check_same_outputs(got, expected)
    # Chunks over 3-4x their length of cached keys pass Q, the others pass K/V.
    assert counters.ring_bytes and counters.query_bytes and counters.partial_bytes
    assert not multiprocessing.active_children()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "cp", "block_size", "interleave"),
    [("gemma3", 2, 4, 4), ("gemma3", 4, 2, 1), ("llama", 4, 2, 2), ("gemma2", 2, 4, 1)],
)
def test_more_ranks_windows_and_softcaps_match_one_process(
    name, cp, block_size, interleave, tiny_models, make_driver, drive, run_scenario,
    check_same_outputs,
) -> None:  # fmt: skip
    """Gemma 3 (sliding windows of 8, GQA, full layers) on cp = 2 with a block interleave
    and cp = 4 with a token interleave, Llama on cp = 4 (a block interleave), Gemma 2
    (soft-capped attention) on cp = 2: the scenario's tokens and logits within 1e-5."""
    expected = run_scenario(make_driver(name))
    path = tiny_models[name].path
    with _context(path, cp, block_size=block_size, kv_interleave=interleave) as executor:
        got = run_scenario(drive(executor))
    check_same_outputs(got, expected)


@pytest.mark.slow
def test_context_ranks_combine_with_pipeline_stages(
    tiny_models, make_driver, drive, run_scenario, check_same_outputs
) -> None:
    """2 stages x 2 context ranks (four processes, one rank layout) match one process."""
    expected = run_scenario(make_driver("llama"))
    with _context(tiny_models["llama"].path, 2, pipeline_parallel_size=2) as executor:
        assert (executor.num_stages, executor.world_size) == (2, 4)
        got = run_scenario(drive(executor))
    check_same_outputs(got, expected)


@pytest.mark.slow
def test_prompt_logprobs_gather_every_rank_rows(tiny_models, prompt_of) -> None:
    """Prompt logprobs need every position's hidden state: cp = 2 gives one process's."""
    prompt = prompt_of(13, 3)
    request = StepRequest(
        request_id="r", token_ids=prompt, start_position=0, block_tables=[[1, 2]],
        sample=True, params=SamplingParams(temperature=0.0, prompt_logprobs=2),
        output_index=0, prompt_logprob_token_ids=prompt[1:],
    )  # fmt: skip
    path = tiny_models["llama"].path
    one = ModelExecutor.from_pretrained(path, LoadOptions(kv_cache_bytes=KV_BYTES, block_size=8))
    expected = one.execute(StepBatch((request,)))
    with _context(path, 2) as executor:
        got = executor.execute(StepBatch((request,)))
    assert got.token_ids == expected.token_ids
    assert got.prompt_logprobs is not None and expected.prompt_logprobs is not None
    for mine, theirs in zip(got.prompt_logprobs[0], expected.prompt_logprobs[0], strict=True):
        assert (mine.token_id, mine.rank) == (theirs.token_id, theirs.rank)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-5)


def test_a_policy_without_one_window_is_refused(tiny_models) -> None:
    """Chunked-local keys are not one window per query: context parallelism says so."""
    options = LoadOptions(
        kv_cache_bytes=KV_BYTES, block_size=4, policies={"full_attention": ChunkedLocal(16)}
    )
    executor = ModelExecutor.from_pretrained(tiny_models["llama"].path, options)
    ranks = ContextRanks(group=None, rank=0, size=2)  # type: ignore[arg-type]
    with pytest.raises(ParallelConfigError, match="keys are one window"):
        ContextParallelExecutor(executor, ranks)


@pytest.mark.parametrize(
    ("name", "policies", "message"),
    [
        ("bamba", None, "'model.layers.0.mamba' is a state layer"),
        ("falcon_h1", None, "'model.layers.0.mamba' is a state layer"),
        ("zamba2", None, "'model.layers.0.mamba' is a state layer"),
        ("llama", {"full_attention": ChunkedLocal(16)}, "keys are one window"),
        ("gpt_oss", None, "attention sinks"),
        ("gemma4", None, "'model.layers.4.self_attn' computes none"),
        ("deepseek_v3", None, "'model.layers.0.self_attn' keeps one latent a token"),
        ("deepseek_v4", None, "'model.layers.0.self_attn' keeps one latent a token"),
    ],
)
def test_layers_the_ranks_cannot_share_are_refused_before_any_process(
    tiny_models, name, policies, message
) -> None:
    """A Mamba2 hybrid (Falcon-H1's beside its attention), a layer whose keys are not one
    window, attention with sinks, a layer reading another's cache, latent attention,
    DeepSeek V4's window of one vector a token: refused at start,
    naming the layer or the sinks, and no worker process started."""
    options = LoadOptions(kv_cache_bytes=KV_BYTES, block_size=4, policies=policies or {})
    with pytest.raises(ParallelConfigError, match=message):
        PipelineExecutor.from_pretrained(
            tiny_models[name].path, options, pipeline_parallel_size=1, context_parallel_size=2
        )
    assert not multiprocessing.active_children()
