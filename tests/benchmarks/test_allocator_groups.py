"""benchmarks/allocator/groups.py: the same workload replayed over each group count."""

from __future__ import annotations

from benchmark_scripts import benchmark_module


def test_each_count_replays_the_workload_in_every_round() -> None:
    groups = benchmark_module("benchmarks.allocator.groups")
    times = groups.group_bench([1, 3], rounds=2)
    assert list(times) == [1, 3]
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in times.values())
