"""Output throughput of the model executor, against transformers and against a uniform layout.

Two parts, in one run, on one random-weight Gemma-3-shaped model (12 layers, 10 sliding
with a 128-token window and 2 full, float32, CPU):

  engine vs hf    64 requests of mixed prompt (32-384) and output (16-128) lengths, greedy.
                  hybridkv: the async Engine doing continuous batching over the
                  ModelExecutor. transformers: ``generate`` on batches of left-padded
                  prompts, each batch running to its longest output (the extra tokens of
                  shorter requests are not counted). Output tokens per second of each.
  hybrid vs uniform  24 requests with prompts of 6 windows (768 tokens) and 256 outputs
                  (``--long-output``), at the same KV bytes: the hybrid layout (sliding
                  layers keep only their window) vs the uniform one (every layer keeps
                  every token). The planner's max concurrent requests, the peak the engine
                  reached, and tokens/s.

    python -m benchmarks.decode.throughput                 # both parts
    python -m benchmarks.decode.throughput --quick         # smaller workload, a smoke run

Timings share the machine with whatever else runs; the ratios are measured in one run.
The last line printed is one JSON object.

Results, and how long a run of both parts takes: docs/benchmarks.md, section "Throughput:
the engine against transformers, hybrid against uniform".
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.memory.layout_planner import describe
from hybridkv.scheduler import Engine, EngineConfig, PoolSpec, SamplingParams, StepBatch, StepResult

WINDOW = 128
BLOCK_SIZE = 16
MODEL: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "query_pre_attn_scalar": 64,
    "sliding_window": WINDOW,
    "max_position_embeddings": 2048,
}


def make_checkpoint(folder: Path) -> Path:
    """A random-weight Gemma 3 text checkpoint (5 sliding : 1 full) saved as safetensors."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    Gemma3ForCausalLM(Gemma3TextConfig(**MODEL)).save_pretrained(folder)
    return folder


def make_checkpoint_off_main(folder: Path) -> Path:
    """``make_checkpoint`` on a short-lived thread, so the main thread starts no OpenMP team.

    The engine runs its model on its executor's torch thread and transformers runs on the
    main thread: each system then has the process's only live OpenMP team while it is
    timed (a second, idle team makes libgomp stop spinning, see executor/torch_thread.py).
    """
    worker = threading.Thread(target=make_checkpoint, args=(folder,))
    worker.start()
    worker.join()
    return folder


def workload(
    num: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int], seed: int
) -> list[tuple[list[int], int]]:
    """``num`` (prompt, output length) pairs with lengths drawn uniformly in the ranges."""
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(3, MODEL["vocab_size"]) for _ in range(rng.randint(*prompt_lens))],
            rng.randint(*output_lens),
        )
        for _ in range(num)
    ]


class CountingExecutor:
    """Wraps an executor to record the largest batch (requests running at once)."""

    def __init__(self, inner: ModelExecutor) -> None:
        self.inner = inner
        self.peak_requests = 0
        self.num_steps = 0

    @property
    def pool(self) -> PoolSpec:
        return self.inner.pool

    def execute(self, batch: StepBatch) -> StepResult:
        self.peak_requests = max(self.peak_requests, len(batch.requests))
        self.num_steps += 1
        return self.inner.execute(batch)


async def generate_all(engine: Engine, requests: list[tuple[list[int], int]]) -> int:
    """Run every (prompt, output length) request at once, greedy, to its length; returns
    the output tokens generated."""
    num_out = 0

    async def consume(prompt: list[int], max_tokens: int) -> None:
        nonlocal num_out
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        async with engine.generate(prompt, params) as stream:
            async for output in stream:
                num_out += len(output.new_token_ids)

    async with anyio.create_task_group() as tg:
        for prompt, max_tokens in requests:
            tg.start_soon(consume, prompt, max_tokens)
    return num_out


async def _run_engine(
    executor: ModelExecutor, requests: list[tuple[list[int], int]], max_num_seqs: int
) -> dict[str, Any]:
    config = EngineConfig.for_executor(
        executor,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=1024,
        max_prefill_chunk=512,
    )
    counting = CountingExecutor(executor)
    start = time.perf_counter()
    async with Engine(config, counting) as engine:
        num_out = await generate_all(engine, requests)
    elapsed = time.perf_counter() - start
    return {
        "seconds": elapsed,
        "output_tokens": num_out,
        "output_tokens_per_s": num_out / elapsed,
        "tokens_per_s": (num_out + sum(len(p) for p, _ in requests)) / elapsed,
        "peak_running": counting.peak_requests,
        "steps": counting.num_steps,
    }


def run_engine(
    executor: ModelExecutor, requests: list[tuple[list[int], int]], max_num_seqs: int = 64
) -> dict[str, Any]:
    """Serve every request through the async Engine; time from first submit to last token."""
    result: dict[str, Any] = anyio.run(_run_engine, executor, requests, max_num_seqs)
    return result


def run_hf(path: Path, requests: list[tuple[list[int], int]], batch_size: int) -> dict[str, Any]:
    """transformers ``generate``, greedy, on left-padded batches in arrival order."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    useful = 0
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        chunk = requests[first : first + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, (prompt, _) in enumerate(chunk):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        longest = max(n for _, n in chunk)
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
            )
        useful += sum(n for _, n in chunk)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": useful, "output_tokens_per_s": useful / elapsed}


def layout_part(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Hybrid vs uniform layout at the same KV bytes, long prompts."""
    prompt_len, out_len = 6 * WINDOW, args.long_output
    requests = workload(args.long_requests, (prompt_len, prompt_len), (out_len, out_len), seed=2)
    # Enough bytes for about `uniform_fit` uniform requests of prompt + output tokens.
    per_token = (
        2 * MODEL["num_key_value_heads"] * MODEL["head_dim"] * 4 * MODEL["num_hidden_layers"]
    )
    budget = args.uniform_fit * (prompt_len + out_len + BLOCK_SIZE) * per_token
    out: dict[str, Any] = {"kv_cache_bytes": budget}
    for name, uniform in (("hybrid", False), ("uniform", True)):
        executor = ModelExecutor.from_pretrained(
            path, LoadOptions(kv_cache_bytes=budget, block_size=BLOCK_SIZE, uniform_layout=uniform)
        )
        report = describe(executor.plan, executor.specs, prompt_len + out_len)
        result = run_engine(executor, requests)
        executor.close()
        result["max_requests"] = report.max_requests
        result["num_blocks"] = executor.plan.num_blocks
        out[name] = result
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a small smoke-run workload")
    parser.add_argument(
        "--long-output",
        type=int,
        default=256,
        help="output tokens of each long-prompt request in the layout part (256): the seed's "
        "experiment decodes 1024 after 6144, so decode, where batch size pays, dominates",
    )
    args = parser.parse_args()
    args.requests = 16 if args.quick else 64
    args.long_requests = 8 if args.quick else 24
    args.uniform_fit = 2 if args.quick else 4
    # The library never configures logging; this script silences per-step events.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint_off_main(Path(tmp))
        requests = workload(args.requests, (32, 384), (16, 128), seed=1)
        executor = ModelExecutor.from_pretrained(
            path, LoadOptions(kv_cache_bytes=256 << 20, num_threads=args.threads)
        )
        ours = run_engine(executor, requests)
        executor.close()  # its thread's OpenMP team would slow transformers down
        del executor
        hf = run_hf(path, requests, batch_size=args.requests)
        layouts = layout_part(path, args)
    summary = {
        "threads": args.threads,
        "requests": args.requests,
        "hybridkv_output_tok_s": round(ours["output_tokens_per_s"], 1),
        "hf_generate_output_tok_s": round(hf["output_tokens_per_s"], 1),
        "speedup_vs_hf": round(ours["output_tokens_per_s"] / hf["output_tokens_per_s"], 2),
        "hybrid_max_requests": layouts["hybrid"]["max_requests"],
        "uniform_max_requests": layouts["uniform"]["max_requests"],
        "hybrid_peak_running": layouts["hybrid"]["peak_running"],
        "uniform_peak_running": layouts["uniform"]["peak_running"],
        "hybrid_output_tok_s": round(layouts["hybrid"]["output_tokens_per_s"], 1),
        "uniform_output_tok_s": round(layouts["uniform"]["output_tokens_per_s"], 1),
        "hybrid_over_uniform_tok_s": round(
            layouts["hybrid"]["output_tokens_per_s"] / layouts["uniform"]["output_tokens_per_s"], 2
        ),
    }
    print_tables(ours, hf, layouts, args)
    print(json.dumps(summary))


def _table(header: Sequence[str], rows: Sequence[Sequence[object]], first: int) -> None:
    """Print a header and rows: the first column left-aligned, the others right-aligned."""
    widths = [first] + [max(len(h), 9) + 2 for h in header[1:]]
    for cells in (header, *rows):
        text = [f"{c:.1f}" if isinstance(c, float) else str(c) for c in cells]
        print(
            text[0].ljust(widths[0])
            + "".join(t.rjust(w) for t, w in zip(text[1:], widths[1:], strict=True))
        )


def print_tables(
    ours: dict[str, Any], hf: dict[str, Any], layouts: dict[str, Any], args: argparse.Namespace
) -> None:
    """Two plain-text tables: engine vs transformers, hybrid vs uniform."""
    print(f"\n{args.requests} mixed requests, {args.threads} threads, float32")
    rows = [
        ("hybridkv Engine", ours["seconds"], ours["output_tokens"], ours["output_tokens_per_s"]),
        ("transformers generate", hf["seconds"], hf["output_tokens"], hf["output_tokens_per_s"]),
    ]
    _table(("system", "seconds", "out tokens", "out tok/s"), rows, first=24)
    mib = layouts["kv_cache_bytes"] / 2**20
    tokens = f"{6 * WINDOW} prompt + {args.long_output} output tokens"
    print(f"\n{args.long_requests} requests of {tokens}, {mib:.1f} MiB of KV cache")
    header = ("layout", "pages", "max reqs", "peak running", "seconds", "out tok/s", "tok/s")
    keys = (
        "num_blocks",
        "max_requests",
        "peak_running",
        "seconds",
        "output_tokens_per_s",
        "tokens_per_s",
    )
    rows = [(name, *(layouts[name][k] for k in keys)) for name in ("hybrid", "uniform")]
    _table(header, rows, first=10)


if __name__ == "__main__":
    main()
