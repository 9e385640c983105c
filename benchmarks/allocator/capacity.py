"""Capacity: requests that fit in a KV budget, the hybrid layout against a uniform one.

For every built-in config (``hybridkv.models.published_shapes.BUILTIN_CONFIGS``), every KV budget
and every request length, the planner's layout (``plan_layout``) and its report
(``describe``, what ``hybridkv plan`` prints): the pages of the pool, the requests of that
many tokens (prompt and output) that fit at once, and the longest single request, under
the hybrid layout and under the uniform one (every layer as full attention, one group, in
the same bytes). Nothing runs: the numbers are the planner's arithmetic, exact.

    python -m benchmarks.allocator.capacity [--budgets 1GiB 4GiB 16GiB]
        [--request-tokens 4096 32768]
                                  [--json FILE]

The last line printed is one JSON object: per config, budget and request length, the
numbers of the table.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from benchmarks.common.results import add_json_argument, write_json
from hybridkv.memory.layout_planner import describe, plan_layout
from hybridkv.memory.sizes import parse_size
from hybridkv.models.published_shapes import BUILTIN_CONFIGS
from hybridkv.models.specs import layer_specs_from_config

BUDGETS = ("1GiB", "4GiB", "16GiB")
REQUEST_TOKENS = (4096, 32768)
DTYPE_BYTES = 2  # bfloat16, hybridkv plan's default


def measure(config: dict[str, Any], budget: str, tokens: int, block_size: int) -> dict[str, Any]:
    """One config, budget and request length: the plan's capacity, hybrid and uniform."""
    specs = layer_specs_from_config(config, DTYPE_BYTES)
    plan = plan_layout(specs, parse_size(budget), block_size)
    report = describe(plan, specs, tokens)
    hybrid, uniform = report.max_requests, report.uniform_max_requests
    return {
        "budget": budget,
        "budget_bytes": parse_size(budget),
        "request_tokens": tokens,
        "block_size": plan.block_size,
        "groups": len(plan.groups),
        "pages": {"hybrid": plan.num_blocks, "uniform": plan.uniform_num_blocks},
        "requests": {"hybrid": hybrid, "uniform": uniform},
        "pages_per_request": {
            "hybrid": report.blocks_per_request,
            "uniform": report.uniform_blocks_per_request,
        },
        "longest_request": {
            "hybrid": report.max_request_tokens,
            "uniform": report.uniform_max_request_tokens,
        },
        "gain": None if not hybrid or not uniform else round(hybrid / uniform, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", nargs="+", default=list(BUDGETS), metavar="SIZE")
    parser.add_argument(
        "--request-tokens", type=int, nargs="+", default=list(REQUEST_TOKENS), metavar="N"
    )
    parser.add_argument("--block-size", type=int, default=16)
    add_json_argument(parser)
    args = parser.parse_args()
    results = {
        name: [
            measure(config, budget, tokens, args.block_size)
            for budget in args.budgets
            for tokens in args.request_tokens
        ]
        for name, config in BUILTIN_CONFIGS.items()
    }
    print("| model | KV budget | request tokens | requests: hybrid | uniform | gain "
          "| longest request: hybrid | uniform |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, rows in results.items():
        for r in rows:
            gain = "" if r["gain"] is None else f"{r['gain']:.2f}x"
            cells = [name, r["budget"], f"{r['request_tokens']:,}",
                     _count(r["requests"]["hybrid"]), _count(r["requests"]["uniform"]), gain,
                     _count(r["longest_request"]["hybrid"]),
                     _count(r["longest_request"]["uniform"])]  # fmt: skip
            print("| " + " | ".join(cells) + " |")
    out = {"dtype": "bfloat16", "configs": results}
    print(json.dumps(out, separators=(",", ":")))
    write_json(args.json, out)


def _count(num: int | None) -> str:
    return "unbounded" if num is None else f"{num:,}"


if __name__ == "__main__":
    main()
