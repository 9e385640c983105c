"""The built-in Gemma 3 270M: greedy output equals transformers' on the same weights.

Slow: the first run converts the GGUF file (about a minute), later runs load the cached
folder. Skipped when the demo extra is not installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from hybridkv.executor.load_options import LoadOptions
from hybridkv.scheduler import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
SHORT_PROMPTS = ("The capital of France is", "def fibonacci(n):\n    ")


def long_prompt() -> str:
    """A prompt well past the 512-token sliding window."""
    lines = [f"Line {i}: the train from station {i} leaves at {i % 24:02d}:{i % 60:02d}."
             for i in range(60)]  # fmt: skip
    return "Timetable.\n" + "\n".join(lines) + "\nSummary: the first train leaves at"


@pytest.fixture(scope="module")
def checkpoint(builtin_gemma3: Path) -> Path:
    """The converted checkpoint folder (converted now if the cache lacks it)."""
    return builtin_gemma3


def reference(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens (stopping at its end-of-sequence tokens)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    out = []
    with torch.inference_mode():
        for ids in prompts:
            tokens = model.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False
            )[0, len(ids) :].tolist()
            out.append(tokens)
    return out


async def ours(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    from hybridkv.executor.model_executor import ModelExecutor

    executor = ModelExecutor.from_pretrained(
        folder, LoadOptions(kv_cache_bytes=64 << 20, block_size=16)
    )
    config = EngineConfig.for_executor(executor, max_model_len=4096)
    results: list[list[int]] = [[] for _ in prompts]

    async def one(i: int, ids: list[int]) -> None:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
        async for output in engine.generate(ids, params):
            results[i].extend(output.new_token_ids)

    with anyio.fail_after(600):
        async with Engine(config, executor) as engine, anyio.create_task_group() as tg:
            for i, ids in enumerate(prompts):
                tg.start_soon(one, i, ids)
    return results


def test_greedy_output_matches_transformers(checkpoint: Path) -> None:
    """Short prompts and one past the window, batched together, match transformers."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    prompts = [tokenizer.encode(p).ids for p in (*SHORT_PROMPTS, long_prompt())]
    assert len(prompts[-1]) > 600
    expected: Any = reference(checkpoint, prompts)
    assert anyio.run(ours, checkpoint, prompts) == expected
