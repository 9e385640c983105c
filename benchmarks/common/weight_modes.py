"""The weight modes the precision benchmarks compare, and stepping a model by hand.

    mode       --dtype    --weights
    float32    float32    dtype        the reference
    bfloat16   bfloat16   dtype        weights, activations and KV cache in bfloat16
    int8       float32    int8         weight-only int8 linear layers and LM head
    int4       float32    int4         weight-only 4-bit, a scale and zero per 32 inputs

``weight_quality.py`` and ``bandwidth.py`` load the built-in model in each mode and drive
its executor step by step, with pages from a real KV cache manager.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.executor.torch_thread import TorchThread
from hybridkv.memory.manager import KVCacheManager
from hybridkv.scheduler import SamplingParams, StepBatch, StepRequest

MODES: dict[str, tuple[torch.dtype, str]] = {
    "float32": (torch.float32, "dtype"),
    "bfloat16": (torch.bfloat16, "dtype"),
    "int8": (torch.float32, "int8"),
    "int4": (torch.float32, "int4"),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)


def builtin_folder() -> Path:
    """The built-in model's converted folder (converted on first use)."""
    from hybridkv.serving.cli.builtin_models import resolve_model

    return resolve_model(None)[1]


def load(
    folder: Path,
    mode: str,
    *,
    threads: int,
    kv_bytes: int = 256 << 20,
    torch_thread: TorchThread | None = None,
) -> ModelExecutor:
    """The model of ``folder`` in weight mode ``mode``; ``torch_thread``: shared with the
    other executors of the run (one OpenMP team, ``executor/torch_thread.py``)."""
    dtype, weights = MODES[mode]
    return ModelExecutor.from_pretrained(
        folder,
        LoadOptions(kv_cache_bytes=kv_bytes, dtype=dtype, weights=weights, num_threads=threads),
        torch_thread=torch_thread,
    )


class Sequence:
    """What the KV cache manager reads of a request."""

    def __init__(self, request_id: str, tokens: list[int]) -> None:
        self.request_id = request_id
        self.all_token_ids = tokens
        self.extra_keys: tuple[object, ...] = ()


def step_batch(
    kv: KVCacheManager,
    seqs: list[Sequence],
    start: int,
    num: int,
    params: SamplingParams = GREEDY,
) -> StepBatch:
    """Every sequence runs tokens ``[start, start + num)`` (greedy unless ``params`` says
    otherwise); their blocks are allocated."""
    items = []
    for seq in seqs:
        assert kv.allocate(seq, num) is not None, "the pool is too small for the workload"
        items.append(
            StepRequest(
                request_id=seq.request_id,
                token_ids=seq.all_token_ids[start : start + num],
                start_position=start,
                block_tables=kv.block_tables(seq.request_id),
                sample=True,
                params=params,
                output_index=0,
            )
        )
    return StepBatch(tuple(items))


def new_cache(executor: ModelExecutor) -> KVCacheManager:
    plan = executor.plan
    return KVCacheManager.for_pool(plan.pool)


def all_logits(executor: ModelExecutor, tokens: list[int], chunk: int) -> torch.Tensor:
    """float32 logits after every position of ``tokens``, ``[len, vocab]``, run ``chunk``
    tokens a step (under 32 rows, quantised layers take the decode path's kernels)."""
    kv = new_cache(executor)
    seq = Sequence("text", tokens)
    out = []
    for start in range(0, len(tokens), chunk):
        batch = step_batch(kv, [seq], start, min(chunk, len(tokens) - start))

        def run(batch: StepBatch = batch) -> torch.Tensor:
            inputs = executor.prepare(batch)
            with torch.inference_mode():
                return executor.model.compute_logits(executor.forward(inputs))

        out.append(executor.torch_thread.run(run))
    return torch.cat(out)
