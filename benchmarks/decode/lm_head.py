"""The rescored LM head against the stored one, on the built-in model, in one executor.

A quantised head runs a 4-bit pass over the vocabulary and recomputes its best
candidates exactly (``models/weights/rescored_head.py``). This loads the built-in Gemma 3 270M
per ``--modes`` and, with ``--batch`` requests decoding after a short prefill, swaps the
model's head between the rescored one and the stored one (the int8 head it wraps) step
by step, so both see the same machine load and the same KV cache:

    head ms     the head alone on the step's last hidden states
    step ms     a whole decode step (sampling at temperature 1 included)
    ratio       rescored / stored per pair of steps: median (q1-q3)

    python -m benchmarks.decode.lm_head [--modes int8 int4] [--batch 1 8] [--steps 20] [--threads 2]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from benchmarks.common.weight_modes import Sequence, builtin_folder, load, new_cache, step_batch
from hybridkv.models.weights.rescored_head import RescoredHead
from hybridkv.scheduler import SamplingParams

SAMPLED = SamplingParams(temperature=1.0, max_tokens=1 << 20)
PREFILL = 256


def _timed(fn: Any) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def _spread(values: list[float]) -> dict[str, float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return {"median": median, "q1": q1, "q3": q3}


def measure(mode: str, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """Head and step times of both heads, alternating step by step."""
    executor = load(builtin_folder(), mode, threads=args.threads)
    model = executor.model
    rescored = model.lm_head
    assert isinstance(rescored, RescoredHead), "the built-in head is stored at 8 bits"
    heads = {"rescored": rescored, "stored": rescored.head}
    kv = new_cache(executor)
    length = PREFILL + 2 * (args.steps + 2) + 1  # a decode step per head, pair by pair
    seqs = [Sequence(f"r{i}", list(range(100 + i, 100 + i + length))) for i in range(batch)]
    executor.execute(step_batch(kv, seqs, 0, PREFILL))
    hidden = torch.randn(batch, model.config.hidden_size)
    times: dict[str, dict[str, list[float]]] = {name: {"head": [], "step": []} for name in heads}
    position = PREFILL
    for i in range(args.steps + 2):
        for name, head in heads.items():
            model.lm_head = head
            step = step_batch(kv, seqs, position, 1, SAMPLED)
            position += 1
            step_s = _timed(lambda step=step: executor.execute(step))
            head_s = executor.torch_thread.run(
                lambda head=head: _timed(lambda: torch.inference_mode()(head)(hidden))
            )
            if i >= 2:  # the first pairs warm up
                times[name]["step"].append(step_s)
                times[name]["head"].append(head_s)
    model.lm_head = rescored
    executor.close()
    out: dict[str, Any] = {}
    for part in ("head", "step"):
        new, old = times["rescored"][part], times["stored"][part]
        out[part] = {
            "rescored_ms": statistics.median(new) * 1e3,
            "stored_ms": statistics.median(old) * 1e3,
            "ratio": _spread([a / b for a, b in zip(new, old, strict=True)]),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=["int8", "int4"], default=["int8", "int4"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    print(
        "| mode | batch | head ms, rescored vs stored | ratio (q1-q3) | step ms | ratio (q1-q3) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for mode in args.modes:
        for batch in args.batch:
            row = measure(mode, batch, args)
            results[f"{mode}/{batch}"] = row
            cells = []
            for part in ("head", "step"):
                r = row[part]
                q = r["ratio"]
                cells.append(f"{r['rescored_ms']:.1f} vs {r['stored_ms']:.1f}")
                cells.append(f"{q['median']:.2f} ({q['q1']:.2f}-{q['q3']:.2f})")
            print(f"| {mode} | {batch} | " + " | ".join(cells) + " |", flush=True)
    print(json.dumps({"threads": args.threads, "steps": args.steps, "results": results}))


if __name__ == "__main__":
    main()
