"""Allocator cost per engine step against the number of KV groups.

The same generated workload (64 running requests, 512-token prompts, full attention)
replayed through ``KVCacheManager`` over N groups, each count in turn for three rounds,
so the counts share the machine's load; the median step time, its spread over the
rounds, and its ratio to the first count. What a layout with more groups pays per step
(a planner that would cut padding by adding groups weighs this)::

    python -m benchmarks.allocator.groups 2 7 40
"""

from __future__ import annotations

import argparse
import json
import statistics

from benchmarks.allocator.allocator import replay
from benchmarks.allocator.workloads import LAYOUTS, generate


def group_bench(counts: list[int], rounds: int) -> dict[int, list[float]]:
    """Per group count, the median step time (us) of each round."""
    times: dict[int, list[float]] = {n: [] for n in counts}
    for n in counts:
        LAYOUTS[f"groups{n}"] = [{"type": "full"}] * n
    for _ in range(rounds):
        for n in counts:
            res = replay(generate(f"groups{n}", 64, False), None, 200)
            times[n].append(res["hybridkv"]["step_us_median"])
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("counts", type=int, nargs="+", help="KV group counts, the first the base")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    times = group_bench(args.counts, args.rounds)
    base = statistics.median(times[args.counts[0]])
    for n, values in times.items():
        median = statistics.median(values)
        spread = f"{min(values):.1f}-{max(values):.1f}"
        print(f"{n:>3} groups  {median:7.1f} us/step ({spread})  {median / base:.2f}x")
    print(
        json.dumps(
            {"step_us_median_by_groups": {n: statistics.median(v) for n, v in times.items()}}
        )
    )


if __name__ == "__main__":
    main()
