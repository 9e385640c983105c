"""The model executor behind the real async Engine: greedy outputs equal transformers'."""

from __future__ import annotations

import pytest
import torch

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.scheduler import EngineConfig, SamplingParams

# About 30 pages of 4 tokens per group: three requests of ~30 tokens cannot all fit.
SMALL_POOL = 30 * 2 * 1024


def _hf_greedy(reference, prompt: list[int], num: int) -> list[int]:
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]), max_new_tokens=num, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.asyncio
async def test_engine_outputs_match_transformers_under_preemption(
    tiny_models, prompt_of, serve_all
):
    """Three concurrent greedy requests in a pool too small for all match transformers."""
    model = tiny_models["gemma3"]
    executor = ModelExecutor.from_pretrained(
        model.path, LoadOptions(kv_cache_bytes=SMALL_POOL, block_size=4)
    )
    config = EngineConfig.for_executor(
        executor, max_model_len=64, max_num_batched_tokens=16, max_prefill_chunk=8
    )
    prompts = [prompt_of(n, 30 + n) for n in (14, 19, 23)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs, stats = await serve_all(executor, config, prompts, params)
    assert stats.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert outputs[i] == _hf_greedy(model.reference, prompt, 10)
