"""benchmarks/allocator/groups.py: the same workload replayed over each group count."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_each_count_replays_the_workload_in_every_round() -> None:
    path = list(sys.path)
    try:
        sys.path.insert(0, str(ROOT))
        groups = importlib.import_module("benchmarks.allocator.groups")
    finally:
        sys.path[:] = path
    times = groups.group_bench([1, 3], rounds=2)
    assert list(times) == [1, 3]
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in times.values())
