"""Time of one decode step of the model executor, and what logprobs add to it.

A random-weight Gemma-3-shaped model (the one of ``throughput.py``), ``--requests``
requests each with ``--context`` tokens already cached, then ``--steps`` decode steps of
one token per request, straight through ``ModelExecutor.execute`` (no engine, no event
loop). Prints the median and the quartiles of the step time, with logprobs off and, with
``--logprobs K``, with every request asking for its sampled token's logprob and top K, in
the same run (the two alternate step by step, so both see the same machine load).

    python -m benchmarks.decode.decode_step [--requests 64] [--context 300] [--logprobs 5]
    python -m benchmarks.decode.decode_step --threads 1 --clock process   # CPU time, less noise

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.weight_modes import Sequence, step_batch
from benchmarks.decode.throughput import MODEL, make_checkpoint_off_main
from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.memory.manager import KVCacheManager
from hybridkv.scheduler import SamplingParams


def quartiles(values: list[float]) -> dict[str, float]:
    """Median and quartiles in milliseconds."""
    q1, median, q3 = statistics.quantiles(values, n=4)
    return {"median_ms": median * 1e3, "q1_ms": q1 * 1e3, "q3_ms": q3 * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--logprobs", type=int, default=None, help="also time logprobs=K")
    parser.add_argument(
        "--clock",
        choices=("wall", "process"),
        default="wall",
        help="process: CPU time of the whole process, steadier on a shared machine",
    )
    args = parser.parse_args()
    greedy = SamplingParams(temperature=0.0, max_tokens=args.steps + 1)
    variants = {"off": greedy}
    if args.logprobs is not None:
        variants[f"logprobs={args.logprobs}"] = SamplingParams(
            temperature=0.0, max_tokens=args.steps + 1, logprobs=args.logprobs
        )
    with tempfile.TemporaryDirectory() as folder:
        path = make_checkpoint_off_main(Path(folder))
        executor = ModelExecutor.from_pretrained(
            path, LoadOptions(kv_cache_bytes=256 << 20, block_size=16, num_threads=args.threads)
        )
    plan = executor.plan
    total = args.context + 2 * args.steps
    times: dict[str, list[float]] = {name: [] for name in variants}
    kv = KVCacheManager.for_pool(plan.pool)
    vocab = MODEL["vocab_size"] - 3
    groups = {}
    for name in variants:
        seqs = [
            Sequence(f"{name}-{i}", [(i * 31 + j * 7) % vocab + 3 for j in range(total)])
            for i in range(args.requests)
        ]
        for start in range(0, args.context, 256):  # prefill, untimed
            num = min(256, args.context - start)
            executor.execute(step_batch(kv, seqs, start, num, greedy))
        groups[name] = seqs
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    for step in range(args.steps):
        for name, params in variants.items():
            seqs = groups[name]
            batch = step_batch(kv, seqs, args.context + step, 1, params)
            begin = clock()
            executor.execute(batch)
            times[name].append(clock() - begin)
    executor.close()
    result: dict[str, Any] = {
        "requests": args.requests,
        "context": args.context,
        "steps": args.steps,
        **{name: quartiles(values) for name, values in times.items()},
    }
    for name, stats in result.items():
        if isinstance(stats, dict):
            print(
                f"{name:14s} median {stats['median_ms']:7.2f} ms  "
                f"(q1 {stats['q1_ms']:.2f}, q3 {stats['q3_ms']:.2f})"
            )
    print(json.dumps(result))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
