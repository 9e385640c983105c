"""What padding K to the int8 kernel's multiple of 16 costs a decode step's linear.

torch's ``_weight_int8pack_mm`` cannot take an input width that is not a multiple of 16
(``models/weights/quantized_linear.py``), so ``Int8Linear`` stores such a weight padded
with zero columns and pads each input alike. For widths real tensor-parallel shards reach,
this times, interleaved round by round so all see the same machine load:

    padded      Int8Linear at width K (the kernel on K' = K rounded up, input padded)
    aligned     the kernel on a weight of width K' given an input of width K' (the
                same work without the per-call pad): the baseline
    dequant     the other safe path: expand the int8 weight and an ordinary matmul

    ratio       each path's time over the aligned one's: median (q1-q3) over --rounds

    python -m benchmarks.decode.int8_padding [--rows 1 4] [--rounds 30] [--threads 2]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common.results import add_json_argument, write_json
from hybridkv.models.weights.quantized_linear import Int8Linear

# (name, in_features K, out_features N): row-parallel shards a decode step multiplies.
SHAPES = [
    ("gpt-oss expert down_proj, -tp 8", 2880 // 8, 2880),
    ("test model's o_proj, -tp 2", 24, 48),
    ("Gemma 3 270M mlp down_proj, -tp 3", 2048 // 3, 640),
    ("aligned control, K = 2880", 2880, 2880),
]


def _time(fn: Callable[[], Any], repeats: int) -> float:
    begin = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - begin) / repeats


def measure(k: int, n: int, rows: int, args: argparse.Namespace) -> dict[str, Any]:
    """Seconds per call of the three paths, and their ratios to the aligned kernel."""
    generator = torch.Generator().manual_seed(0)
    layer = Int8Linear(torch.randn(n, k, generator=generator) * 0.05)
    x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    padded_x = torch.nn.functional.pad(x, (0, layer.qweight.shape[1] - k))
    paths: dict[str, Callable[[], Any]] = {
        "padded": lambda: layer.matmul_bf16(x),
        "aligned": lambda: torch.ops.aten._weight_int8pack_mm(
            padded_x, layer.qweight, layer.scales
        ),
        "dequant": lambda: x @ layer.expand(0, n, torch.bfloat16).T,
    }
    for fn in paths.values():
        _time(fn, args.repeats)  # warm up
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, fn in paths.items():
            times[name].append(_time(fn, args.repeats))
    result: dict[str, Any] = {"K": k, "K_padded": layer.qweight.shape[1], "N": n, "rows": rows}
    for name, values in times.items():
        ratios = [v / a for v, a in zip(values, times["aligned"], strict=True)]
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        result[name] = {
            "us": statistics.median(values) * 1e6,
            "ratio": {"median": median, "q1": q1, "q3": q3},
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=20, help="calls timed together")
    parser.add_argument("--threads", type=int, default=2)
    add_json_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    header = (
        f"{'shape':38} {'K':>5} {'rows':>4} {'aligned us':>10}  {'padded':>16}  {'dequant':>16}"
    )
    print(header)
    for name, k, n in SHAPES:
        for rows in args.rows:
            r = measure(k, n, rows, args)
            results.append({"shape": name, **r})
            cells = [
                "{median:.2f} ({q1:.2f}-{q3:.2f})".format(**r[path]["ratio"])
                for path in ("padded", "dequant")
            ]
            print(
                f"{name:38} {k:>5} {rows:>4} {r['aligned']['us']:>10.1f}  {cells[0]:>16}  "
                f"{cells[1]:>16}"
            )
    out = {"threads": args.threads, "results": results}
    write_json(args.json, out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
