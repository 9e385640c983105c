"""Every architecture the suite compares with transformers, once on the device against its
CPU tokens: the tiny checkpoints of ``hybridkv.testing.tiny_models``, greedy, float32.

A prompt longer than every window and SSD chunk of the tiny models runs in 7-token prefill
chunks and then decodes; the device's tokens must equal the CPU's and its last-step logits
stay within 1e-3 of them (TF32 off).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.memory.manager import KVCacheManager
from hybridkv.scheduler.batch import StepBatch, StepRequest
from hybridkv.scheduler.params import SamplingParams
from hybridkv.testing.tiny_models import TINY_ARCHITECTURES, save_tiny

PROMPT, CHUNK, NEW_TOKENS = 40, 7, 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


def generate(path: Path, device: torch.device) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of one prompt and the logits of its last step."""
    options = LoadOptions(kv_cache_bytes=1 << 20, block_size=4, device=str(device))
    executor = ModelExecutor.from_pretrained(path, options)
    logits: list[torch.Tensor] = []
    executor.logits_hook = lambda _, row: logits.append(row.float().cpu())
    kv = KVCacheManager.for_pool(executor.plan.pool, enable_prefix_caching=False)
    tokens = torch.randint(3, 256, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    request = _Sequence(tokens)
    done = 0
    try:
        while len(request.all_token_ids) < PROMPT + NEW_TOKENS:
            n = min(CHUNK, len(request.all_token_ids) - done)
            assert kv.allocate(request, n, None) is not None, "the tiny pool is full"
            step = StepRequest(
                request_id=request.request_id,
                token_ids=request.all_token_ids[done : done + n],
                start_position=done,
                block_tables=[list(t) for t in kv.block_tables(request.request_id)],
                sample=done + n == len(request.all_token_ids),
                params=GREEDY,
                output_index=len(request.all_token_ids) - PROMPT,
            )
            (token,) = executor.execute(StepBatch((step,))).token_ids
            done += n
            if token is not None:
                request.all_token_ids.append(token)
    finally:
        executor.close()
    return request.all_token_ids[PROMPT:], logits[-1]


class _Sequence:
    """What the KV cache manager reads of a request."""

    def __init__(self, prompt: list[int]) -> None:
        self.request_id = "r"
        self.all_token_ids = list(prompt)
        self.extra_keys: tuple[object, ...] = ()


def run(device: torch.device, folder: Path) -> dict[str, Any]:
    """Each architecture's verdict: passed, or what differed."""
    out: dict[str, Any] = {}
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        for seed, name in enumerate(TINY_ARCHITECTURES):
            try:
                path = save_tiny(name, folder / name, seed=seed)
                got, got_logits = generate(path, device)
                want, want_logits = generate(path, torch.device("cpu"))
                diff = float((got_logits - want_logits).abs().max())
                out[name] = {
                    "passed": got == want and diff <= 1e-3,
                    "tokens_equal": got == want,
                    "last_logits_max_abs_diff": diff,
                }
            except Exception as error:  # one architecture's failure is its verdict
                out[name] = {"passed": False, "error": repr(error)[:300]}
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    return out
