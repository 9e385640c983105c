"""Tensor parallelism on the CPU: step time at tp = 1 and 2, bytes all-reduced, pages per rank.

The random-weight Llama-shaped model of ``context_parallel.py`` (4 layers, hidden 256,
8 query heads over 2 KV heads of 64, MLP 512, float32) runs two kinds of step:

  prefill     one prompt of ``--prompt`` tokens in one step
  decode      one token for each of ``--batch`` requests with ``--context`` tokens cached

in three settings, with the same cores in all:

  tp = 1, 1 thread     ModelExecutor, the baseline
  tp = 1, 2 threads    the same on both cores (what tp = 2 competes with on 2 cores)
  tp = 2, 1 thread     PipelineExecutor(tensor_parallel_size=2): two gloo processes, each
                       with half the heads, half the MLP and half the vocabulary

Each runs ``--repeats`` rounds, round robin (the machine is shared); it prints the median
time of each, the speed-up of tp = 2 over one thread and over two threads as the median
of the per-round ratios, with their range.

Bytes: what rank 0 all-reduced per step (after each attention and MLP block, and the
embedding) against the formula ``hidden x tokens x 4 bytes x (2 x layers + 1)``, what
it gathered of the logits (its half of the vocabulary per sampled row), and the time rank
0 spent inside those collectives (waiting for the other rank included). Pages: the pool
each process lays out in the same ``KV_BYTES``: a rank holds one of the two KV heads, so
twice the pages.

    python -m benchmarks.parallel.tensor_parallel [--json FILE]   # the full run (about 2 minutes)
    python -m benchmarks.parallel.tensor_parallel --quick         # a smoke run

The last line printed is one JSON object. Results: docs/benchmarks.md, section "Tensor
parallelism on two cores".
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch

from benchmarks.common.results import add_json_argument, write_json
from benchmarks.parallel.context_parallel import MODEL, make_checkpoint, timed
from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.parallel.pipeline_executor import PipelineExecutor
from hybridkv.parallel.tensor_layers import SummedOverRanks
from hybridkv.scheduler import SamplingParams
from hybridkv.scheduler.batch import StepBatch, StepRequest

BLOCK_SIZE = 16
KV_BYTES = 256 << 20
DTYPE_BYTES = 4


def _steps(tokens: list[list[int]], context: int) -> tuple[StepBatch, StepBatch]:
    """Each request's first ``context`` tokens as one prefill step, then one decode step
    of its next token; request ``i`` on its own run of pages."""
    pages = -(-(context + 1) // BLOCK_SIZE)

    def step(start: int, num: int) -> StepBatch:
        return StepBatch(
            tuple(
                StepRequest(
                    request_id=str(i),
                    token_ids=ids[start : start + num],
                    start_position=start,
                    block_tables=[list(range(1 + i * pages, 1 + (i + 1) * pages))],
                    sample=True,
                    params=SamplingParams(temperature=0.0),
                    output_index=0,
                )
                for i, ids in enumerate(tokens)
            )
        )

    return step(0, context), step(context, 1)


def _counters(executor: PipelineExecutor) -> Any:
    """Rank 0's tensor counters (every sharded layer shares them)."""
    for module in executor.stage0.model.modules():
        if isinstance(module, SummedOverRanks):
            return module.ranks.counters
    raise AssertionError("a tensor-parallel model has summed layers")


def measure(path: Path, cases: dict[str, tuple[int, int]], repeats: int) -> dict[str, Any]:
    """Per case (requests, context): times of every setting, round robin, and bytes."""
    load = functools.partial(LoadOptions, kv_cache_bytes=KV_BYTES, block_size=BLOCK_SIZE)
    one = ModelExecutor.from_pretrained(path, load(num_threads=1))
    two_threads = ModelExecutor.from_pretrained(path, load(num_threads=2))
    results: dict[str, Any] = {"pages": {"tp1": one.pool.num_blocks}, "rows": []}
    with PipelineExecutor.from_pretrained(
        path, load(num_threads=1), pipeline_parallel_size=1, tensor_parallel_size=2,
        step_timeout_s=600.0,
    ) as tp2:  # fmt: skip
        results["pages"]["tp2"] = tp2.pool.num_blocks
        counters = _counters(tp2)
        executors: dict[str, Callable[[StepBatch], object]] = {
            "tp1": one.execute, "tp1_2threads": two_threads.execute, "tp2": tp2.execute,
        }  # fmt: skip
        for name, (batch, context) in cases.items():
            tokens = torch.randint(3, MODEL["vocab_size"], (batch, context + 1)).tolist()
            prefill, decode = _steps(tokens, context)
            times: dict[str, list[float]] = {k: [] for k in executors}
            sent: list[tuple[int, int, float]] = []
            for round_ in range(repeats + 1):  # the first round warms up
                for key, execute in executors.items():
                    if name == "decode":
                        execute(prefill)  # the context, cached before the timed step
                    before = (
                        counters.reduced_bytes, counters.gathered_bytes, counters.collective_s
                    )  # fmt: skip
                    seconds = timed(
                        functools.partial(execute, decode if name == "decode" else prefill)
                    )
                    if round_:
                        times[key].append(seconds)
                        if key == "tp2":
                            sent.append(
                                (counters.reduced_bytes - before[0],
                                 counters.gathered_bytes - before[1],
                                 counters.collective_s - before[2])
                            )  # fmt: skip
            num_tokens = batch if name == "decode" else batch * context
            layers, hidden = MODEL["num_hidden_layers"], MODEL["hidden_size"]
            ratios = [a / b for a, b in zip(times["tp1"], times["tp2"], strict=True)]
            versus_two = [a / b for a, b in zip(times["tp1_2threads"], times["tp2"], strict=True)]
            results["rows"].append(
                {
                    "step": name,
                    "requests": batch,
                    "tokens": num_tokens,
                    "median_s": {k: statistics.median(v) for k, v in times.items()},
                    "speedup_median": statistics.median(ratios),
                    "speedup_range": [min(ratios), max(ratios)],
                    "speedup_vs_2_threads": statistics.median(versus_two),
                    "speedup_vs_2_threads_range": [min(versus_two), max(versus_two)],
                    "reduced_bytes_rank0": statistics.median(r for r, _, _ in sent),
                    "formula_reduced_bytes": hidden * num_tokens * DTYPE_BYTES * (2 * layers + 1),
                    "gathered_bytes_rank0": statistics.median(g for _, g, _ in sent),
                    "collective_s_rank0": statistics.median(c for _, _, c in sent),
                    "formula_gathered_bytes": batch * MODEL["vocab_size"] // 2 * DTYPE_BYTES,
                }
            )
    one.close()
    two_threads.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short steps, one round")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (7)")
    parser.add_argument("--prompt", type=int, default=1024, help="prefill tokens (1024)")
    parser.add_argument("--batch", type=int, default=8, help="decoding requests (8)")
    parser.add_argument("--context", type=int, default=512, help="their cached tokens (512)")
    add_json_argument(parser)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.manual_seed(0)
    if args.quick:
        cases, repeats = {"prefill": (1, 128), "decode": (4, 64)}, 1
    else:
        cases = {"prefill": (1, args.prompt), "decode": (args.batch, args.context)}
        repeats = args.repeats
    with tempfile.TemporaryDirectory() as folder:
        results = measure(make_checkpoint(Path(folder)), cases, repeats)
    kib = 1 << 10
    print(f"pages in {KV_BYTES >> 20} MiB per process: tp1 {results['pages']['tp1']}, "
          f"tp2 {results['pages']['tp2']}")  # fmt: skip
    print(f"{'step':>7} {'tokens':>6} {'tp1 1t ms':>9} {'tp1 2t ms':>9} {'tp2 ms':>7} "
          f"{'vs 1t (range)':>17} {'vs 2t (range)':>17} {'reduced KiB':>11} "
          f"{'formula KiB':>11} {'gathered KiB':>12} {'in collectives ms':>17}")  # fmt: skip
    for r in results["rows"]:
        t = {k: 1000 * v for k, v in r["median_s"].items()}
        low, high = r["speedup_range"]
        low2, high2 = r["speedup_vs_2_threads_range"]
        print(
            f"{r['step']:>7} {r['tokens']:>6} {t['tp1']:>9.1f} {t['tp1_2threads']:>9.1f} "
            f"{t['tp2']:>7.1f} {r['speedup_median']:>5.2f} ({low:.2f}-{high:.2f}) "
            f"{r['speedup_vs_2_threads']:>5.2f} ({low2:.2f}-{high2:.2f}) "
            f"{r['reduced_bytes_rank0'] / kib:>11.1f} {r['formula_reduced_bytes'] / kib:>11.1f} "
            f"{r['gathered_bytes_rank0'] / kib:>12.1f} {1000 * r['collective_s_rank0']:>17.1f}"
        )
    summary = {"model": MODEL, "repeats": repeats, "block_size": BLOCK_SIZE, **results}
    print(json.dumps(summary))
    write_json(args.json, summary)


if __name__ == "__main__":
    main()
