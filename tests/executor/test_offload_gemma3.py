"""Seed 002's scenario on the built-in Gemma 3 270M: a long prompt's prefix, flushed from
the pool by other prompts, is loaded from a host tier for the same prompt with a new
question; the tokens equal recomputation's. A prefix that can never fit fails clearly.

Slow: loads the built-in model (converted from its GGUF on first use).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from hybridkv.memory.offload import HostTier, OffloadConfig
from hybridkv.scheduler import Engine, EngineConfig, PromptTooLongError, SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 4


@pytest.fixture(scope="module")
def checkpoint(builtin_gemma3: Path) -> Path:
    return builtin_gemma3


def timetable(first: int, num_lines: int = 50) -> str:
    """A document well past the 512-token sliding window (about 1,000 tokens)."""
    lines = [f"Line {i}: the train from station {i} leaves at {i % 24:02d}:{(i * 7) % 60:02d}."
             for i in range(first, first + num_lines)]  # fmt: skip
    return "Timetable.\n" + "\n".join(lines)


async def serve(folder: Path, prompts: list[str], offload: OffloadConfig | None, **kw: Any) -> Any:
    """Greedy tokens of each prompt in turn, and the engine (for its stats)."""
    from hybridkv.executor.load_options import LoadOptions
    from hybridkv.executor.model_executor import ModelExecutor

    executor = ModelExecutor.from_pretrained(folder, LoadOptions(block_size=16, **kw))
    assert executor.tokenizer is not None
    config = EngineConfig.for_executor(executor, max_model_len=4096)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = []
    try:
        with anyio.fail_after(900):
            async with Engine(config, executor, offload=offload) as engine:
                for text in prompts:
                    ids = executor.tokenizer.encode(text).ids
                    try:
                        stream = engine.generate(ids, params)
                    except PromptTooLongError as exc:
                        outputs.append(exc)
                        continue
                    tokens: list[int] = []
                    async for out in stream:
                        tokens.extend(out.new_token_ids)
                    outputs.append(tokens)
                    if executor.transfers is not None:
                        assert executor.transfers.wait_saved(60)
    finally:
        executor.close()
    return outputs


@pytest.mark.asyncio
async def test_a_flushed_long_prefix_loads_from_host_memory(checkpoint: Path) -> None:
    """Store, flush, ask again: the prefix comes from the tier, the tokens are the same."""
    doc = timetable(0)
    prompts = [
        doc + "\nQuestion: when does the train from station 3 leave?\nAnswer:",
        timetable(500),
        doc + "\nQuestion: which station has the last train?\nAnswer:",
    ]
    offload = OffloadConfig(tiers=[HostTier(1 << 30)], save_interval=512)
    outputs = await serve(checkpoint, prompts, offload, kv_cache_bytes=24 << 20)
    assert offload.stats.hit_tokens["host"] >= 512
    (expected,) = await serve(checkpoint, prompts[-1:], None, kv_cache_bytes=24 << 20)
    assert outputs[-1] == expected


@pytest.mark.asyncio
async def test_a_prefix_the_pool_can_never_hold_fails_with_a_clear_error(
    checkpoint: Path,
) -> None:
    """A stored prompt longer than a small pool can hold is refused at once, naming the
    pages it needs, and the engine serves the next request (vLLM #39734 waited forever)."""
    offload = OffloadConfig(tiers=[HostTier(1 << 30)], save_interval=512)
    prompt = timetable(0) + "\nQuestion: which train leaves first?"
    outputs = await serve(checkpoint, [prompt, "The capital of France is"], offload,
                          kv_cache_bytes=4 << 20)  # fmt: skip
    assert isinstance(outputs[0], PromptTooLongError) and "pages" in str(outputs[0])
    assert len(outputs[1]) == NEW_TOKENS
