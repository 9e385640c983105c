"""The engine on the device: output throughput of a 0.5B-shaped random Llama (Qwen2.5-0.5B's
shape: 24 layers of 896, 14 query and 2 KV heads, a 151,936 vocabulary), and its memory
against what the plan says it takes.

The forecast is the weights' bytes plus the KV pool the layout planner laid out; beside it,
what torch allocated after loading and at its peak over the run
(``torch.cuda.max_memory_allocated``): the difference is activations, the gather workspace
and the sampler's logits.

A second, short run counts the step loop's host syncs: under
``torch.cuda.set_sync_debug_mode("warn")`` every call that waits for the device warns, and
each warning names the line that made it. The sampled ids must come back each step;
anything else is a sync to remove.
"""

from __future__ import annotations

import collections
import contextlib
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import torch

from benchmarks.gpu.device import Probe
from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.scheduler import Engine, EngineConfig, SamplingParams

REAL_SHAPE: dict[str, Any] = {
    "vocab_size": 151_936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}
TOY_SHAPE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}


def save_model(folder: Path, shape: dict[str, Any]) -> Path:
    """A random Llama of ``shape`` in bf16, weights N(0, 0.02^2) as transformers inits them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**shape, max_position_embeddings=4096, rope_theta=1e6, dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def run(probe: Probe, folder: Path, dry_run: bool) -> dict[str, Any]:
    """Load, serve ``requests`` prompts at once, and report tokens per second and memory."""
    device = probe.device
    shape = TOY_SHAPE if dry_run else REAL_SHAPE
    requests, prompt_len, max_tokens = (8, 64, 16) if dry_run else (64, 512, 128)
    started = time.perf_counter()
    save_model(folder, shape)
    written_s = time.perf_counter() - started
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    kv_bytes = (16 << 20) if dry_run else (4 << 30)
    options = LoadOptions(kv_cache_bytes=kv_bytes, dtype=torch.bfloat16, device=str(device))
    executor = ModelExecutor.from_pretrained(folder, options)
    weights = sum(p.numel() * p.element_size() for p in executor.model.parameters())
    pool = executor.plan.pool_bytes
    loaded = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    config = EngineConfig.for_executor(executor, max_model_len=prompt_len + max_tokens)
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, shape["vocab_size"], (prompt_len,), generator=generator).tolist()
        for _ in range(requests)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    try:
        outputs, seconds = anyio.run(_serve, executor, config, prompts, params)
    finally:
        executor.close()
        del executor
    generated = sum(len(o) for o in outputs)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    syncs = _count_syncs(folder, options, config, prompts[:8], max_tokens=16)
    return {
        "host_syncs_over_16_steps_by_line": syncs,
        "shape": shape,
        "requests": requests,
        "prompt_tokens": prompt_len,
        "max_tokens": max_tokens,
        "checkpoint_written_s": round(written_s, 1),
        "seconds": round(seconds, 3),
        "output_tokens": generated,
        "output_tokens_per_s": round(generated / seconds, 1),
        "weights_bytes": weights,
        "kv_pool_bytes": pool,
        "forecast_bytes": weights + pool,
        "allocated_after_load_bytes": loaded,
        "max_allocated_bytes": peak,
    }


async def _serve(
    executor: ModelExecutor,
    config: EngineConfig,
    prompts: list[list[int]],
    params: SamplingParams,
) -> tuple[list[list[int]], float]:
    """Every prompt at once through one engine; their tokens, and the seconds it took."""
    outputs: list[list[int]] = [[] for _ in prompts]

    async def consume(engine: Engine, i: int) -> None:
        async with engine.generate(prompts[i], params) as stream:
            async for out in stream:
                outputs[i] = list(out.token_ids)

    async with Engine(config, executor) as engine:
        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(consume, engine, i)
        seconds = time.perf_counter() - started
    return outputs, seconds


def _count_syncs(
    folder: Path,
    options: LoadOptions,
    config: EngineConfig,
    prompts: list[list[int]],
    max_tokens: int,
) -> dict[str, int] | None:
    """Device waits during a short run, by the line that made them (None on the CPU,
    where nothing waits)."""
    executor = ModelExecutor.from_pretrained(folder, options)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    try:
        with _sync_warnings(executor.device) as seen:
            anyio.run(_serve, executor, config, prompts, params)
    finally:
        executor.close()
    return None if seen is None else dict(seen.most_common())


@contextlib.contextmanager
def _sync_warnings(device: torch.device) -> Iterator[collections.Counter[str] | None]:
    """Count CUDA's synchronizing-call warnings by ``file:line`` (every thread's: the
    filters and the hook are process-wide)."""
    if device.type != "cuda":
        yield None
        return
    seen: collections.Counter[str] = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            seen[f"{Path(w.filename).name}:{w.lineno}"] += 1
