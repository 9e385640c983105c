"""What verifying ``k`` proposed tokens costs against one decode step, on the built-in model.

Speculative decoding pays when a target step over a request's last token and ``k``
proposals (``k + 1`` rows, logits at every one) costs little more than a decode step of
one row. This measures that ratio on the built-in Gemma 3 270M in a weight mode of
``_weight_modes.MODES``, straight through the executor (no engine): ``--batch`` requests
with ``--context`` tokens cached, then steps of 1 and of ``1 + k`` tokens per request for
each ``k`` of ``--k``, alternating step by step so every variant sees the same load, each
timed from the batch to the logits of every row (``prepare``, ``forward``,
``compute_logits``). A ratio of 1.0 means verification is free; the break-even of a
proposer is a mean of ``ratio - 1`` accepted tokens per step.

    python -m benchmarks.speculative.verify_cost [--mode int8] [--batch 1 8] [--k 2 4 8]
        [--json FILE]

Prints, per batch and ``k``, the median step time and the median ratio with its
quartiles over ``--repeats`` rounds; the last line is one JSON object. Results:
docs/benchmarks.md, section "What verifying proposals costs".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from benchmarks.common.results import add_json_argument, write_json
from benchmarks.common.weight_modes import (
    MODES,
    Sequence,
    builtin_folder,
    load,
    new_cache,
    step_batch,
)


def time_step(executor: Any, batch: Any) -> float:
    def run() -> None:
        inputs = executor.prepare(batch)
        executor.model.compute_logits(executor.forward(inputs))

    begin = time.perf_counter()
    executor.torch_thread.run(run)
    return time.perf_counter() - begin


def measure(executor: Any, batch: int, ks: list[int], args: argparse.Namespace) -> Any:
    """Per ``k`` (0 = a decode step), the step times of ``--steps`` steps."""
    kv = new_cache(executor)
    variants = [0, *ks]
    total = args.context + args.steps * (max(variants) + 1) + 1
    seqs = {
        k: [
            Sequence(
                f"b{batch}-k{k}-{i}", [(i * 131 + j * 17 + k) % 200_000 + 3 for j in range(total)]
            )
            for i in range(batch)
        ]
        for k in variants
    }
    for k in variants:  # the context, untimed
        for start in range(0, args.context, 256):
            num = min(256, args.context - start)
            time_step(executor, step_batch(kv, seqs[k], start, num))
    positions = dict.fromkeys(variants, args.context)
    times: dict[int, list[float]] = {k: [] for k in variants}
    for _ in range(args.steps):
        for k in variants:
            batch_ = step_batch(kv, seqs[k], positions[k], k + 1)
            times[k].append(time_step(executor, batch_))
            positions[k] += k + 1
    for k in variants:
        for seq in seqs[k]:
            kv.free(seq.request_id)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="int8", choices=sorted(MODES))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    add_json_argument(parser)
    args = parser.parse_args()
    executor = load(builtin_folder(), args.mode, threads=args.threads, kv_bytes=512 << 20)
    results: dict[str, Any] = {"mode": args.mode, "context": args.context, "rows": []}
    print("| batch | k | rows | step ms (median) | ratio to a decode step: median (q1-q3) |")
    print("| --- | --- | --- | --- | --- |")
    for batch in args.batch:
        ratios: dict[int, list[float]] = {k: [] for k in args.k}
        medians: dict[int, list[float]] = {k: [] for k in [0, *args.k]}
        for _ in range(args.repeats):
            times = measure(executor, batch, args.k, args)
            base = statistics.median(times[0])
            medians[0].append(base)
            for k in args.k:
                medians[k].append(statistics.median(times[k]))
                ratios[k].append(statistics.median(times[k]) / base)
        for k in [0, *args.k]:
            step_ms = statistics.median(medians[k]) * 1e3
            row: dict[str, Any] = {
                "batch": batch,
                "k": k,
                "rows": batch * (k + 1),
                "step_ms": step_ms,
            }
            cell = "1.00"
            if k:
                q1, median, q3 = statistics.quantiles(ratios[k], n=4, method="inclusive")
                row |= {"ratio": median, "ratio_q1": q1, "ratio_q3": q3, "ratios": ratios[k]}
                cell = f"{median:.2f} ({q1:.2f}-{q3:.2f})"
            results["rows"].append(row)
            print(f"| {batch} | {k} | {row['rows']} | {step_ms:.1f} | {cell} |", flush=True)
    executor.close()
    print(json.dumps(results))
    write_json(args.json, results)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
