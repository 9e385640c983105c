"""The memory-bandwidth floor of a decode step, per weight mode, and how close we get.

A decode step reads every weight once (the built-in Gemma 3 270M: 18 layers and a tied
640 x 262,144 LM head), so its time is at least weight bytes / read bandwidth. This
measures the machine's read bandwidth (summing a buffer far larger than the caches, with
the same threads as the model), then per mode:

    weight MB   bytes one decode step reads (linear layers, LM head, norms)
    floor ms    weight MB / bandwidth
    step ms     median decode step, batch 1 and batch N, after a short prefill
    of floor    floor / step: 1.0 is the bandwidth limit
    kernel ms   of a step, the time in the products with the weights (torch's weight-only
                kernels, or mm/addmm in the float modes), from torch's profiler over
                ``--profile-steps`` further steps: the part of the step no op outside
                them can remove
    ops         torch ops one step dispatches (counted, not timed: the same every run)

Modes interleave step by step (each decodes its own requests), so they see the same
machine load; the spread is the quartiles over ``--steps`` steps. ``--clock process``
times each step in CPU time of the process instead of wall time: with ``--threads 1`` it
barely moves when other work shares the machine (the floor is then the wall-clock one,
not comparable).

    python -m benchmarks.decode.bandwidth [--modes float32 bfloat16 int8 int4] [--batch 1 8]
                                   [--threads 2] [--steps 20] [--context 256]
                                   [--clock wall|process] [--profile-steps 5]

The last line printed is one JSON object.

Results: docs/benchmarks.md, section "Decode on the CPU: weight precision, the bandwidth
floor, llama.cpp".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common.weight_modes import (
    MODES,
    Sequence,
    builtin_folder,
    load,
    new_cache,
    step_batch,
)
from hybridkv.executor.torch_thread import TorchThread
from hybridkv.models.weights.precision import decode_weight_bytes


def read_bandwidth(threads: int, size_mb: int = 1024, repeats: int = 5) -> float:
    """Bytes per second ``torch.sum`` reads from a ``size_mb`` float32 buffer (best of)."""
    torch.set_num_threads(threads)
    buffer = torch.ones(size_mb << 18)
    buffer.sum()  # fault the pages in
    best = min(_timed(buffer.sum) for _ in range(repeats))
    return buffer.numel() * buffer.element_size() / best


#: The ops that multiply by the weights (in the float modes mm/addmm: attention's
#: products are bmm).
WEIGHT_KERNELS = frozenset(
    {
        "aten::_weight_int8pack_mm",
        "aten::_weight_int4pack_mm_for_cpu",
        "aten::mm",
        "aten::addmm",
    }
)


class _OpCount(TorchDispatchMode):
    """Counts the ops dispatched while it is active (on the thread that enters it)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        return func(*args, **(kwargs or {}))


def profile_steps(executor: Any, batches: list[Any]) -> tuple[float, int]:
    """Per step of ``batches`` (run here, on the executor's torch thread): milliseconds in
    the weight kernels, and ops dispatched (counted on the last step)."""

    def step(batch: Any) -> None:
        inputs = executor.prepare(batch)
        executor.finish(batch, inputs, executor.forward(inputs))

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in batches[:-1]:
            step(batch)
    kernel_us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in WEIGHT_KERNELS)
    with _OpCount() as counter:
        step(batches[-1])
    return kernel_us / 1e3 / (len(batches) - 1), counter.count


def _timed(fn: Any) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--clock", choices=("wall", "process"), default="wall")
    parser.add_argument("--profile-steps", type=int, default=5)
    args = parser.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    torch.set_grad_enabled(False)
    # One thread runs every torch op of the run: a second OpenMP team (the bandwidth
    # sum on this thread, or a thread per executor) makes libgomp stop spinning between
    # parallel regions, which slows the steps (executor/torch_thread.py; the measured cost
    # is in docs/benchmarks.md, with this script's results).
    thread = TorchThread(args.threads)
    bandwidth = thread.run(read_bandwidth, args.threads)
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s ({args.threads} threads)", flush=True)
    folder = builtin_folder()
    runs: dict[tuple[str, int], Any] = {}
    executors = {
        mode: load(folder, mode, threads=args.threads, torch_thread=thread) for mode in args.modes
    }
    weight_bytes = {mode: decode_weight_bytes(ex.model) for mode, ex in executors.items()}
    for mode, executor in executors.items():
        for batch in args.batch:
            kv = new_cache(executor)
            seqs = [
                Sequence(f"{mode}-{batch}-{i}", [(i * 31 + j * 7) % 30000 + 3 for j in range(2048)])
                for i in range(batch)
            ]
            executor.execute(step_batch(kv, seqs, 0, args.context))  # prefill, untimed
            runs[mode, batch] = (kv, seqs, [])
    for step in range(args.steps):
        for (mode, _), (kv, seqs, times) in runs.items():
            batch_of = step_batch(kv, seqs, args.context + step, 1)
            begin = clock()
            executors[mode].execute(batch_of)
            times.append(clock() - begin)
    profiled: dict[tuple[str, int], tuple[float, int]] = {}
    for (mode, batch), (kv, seqs, _) in runs.items():
        start = args.context + args.steps
        batches = [step_batch(kv, seqs, start + i, 1) for i in range(args.profile_steps + 1)]
        profiled[mode, batch] = thread.run(profile_steps, executors[mode], batches)
    result: dict[str, Any] = {
        "bandwidth_gb_s": bandwidth / 1e9,
        "threads": args.threads,
        "clock": args.clock,
    }
    print(
        f"{'mode':9s} {'weight MB':>9s} {'floor ms':>8s}  "
        + "  ".join(
            f"{'batch ' + str(b) + ' ms (q1-q3)':>24s} {'of floor':>8s} {'kernel ms':>9s} "
            f"{'ops':>5s}"
            for b in args.batch
        )
    )
    for mode in args.modes:
        floor = weight_bytes[mode] / bandwidth
        row: dict[str, Any] = {"weight_mb": weight_bytes[mode] / 1e6, "floor_ms": floor * 1e3}
        cells = []
        for batch in args.batch:
            q1, median, q3 = statistics.quantiles(runs[mode, batch][2], n=4)
            kernel_ms, ops = profiled[mode, batch]
            row[f"batch{batch}"] = {
                "median_ms": median * 1e3, "q1_ms": q1 * 1e3, "q3_ms": q3 * 1e3,
                "of_floor": floor / median, "kernel_ms": kernel_ms, "ops": ops,
            }  # fmt: skip
            cells.append(
                f"{median * 1e3:8.1f} ({q1 * 1e3:6.1f}-{q3 * 1e3:6.1f}) {floor / median:8.2f} "
                f"{kernel_ms:9.1f} {ops:5d}"
            )
        result[mode] = row
        print(
            f"{mode:9s} {row['weight_mb']:9.0f} {row['floor_ms']:8.1f}  "
            + "  ".join(f"{c:>49s}" for c in cells)
        )
    for executor in executors.values():
        executor.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
