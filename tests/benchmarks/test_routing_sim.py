"""benchmarks/routing/policies.py's simulated part: its quick run keeps the invariants of its
measures, and its faster index answers as the router's own."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from benchmark_scripts import benchmark_module


@pytest.fixture(scope="module")
def routing() -> ModuleType:
    """The script, imported from the repository root."""
    return benchmark_module("benchmarks.routing.policies")


@pytest.fixture(scope="module")
def quick(routing: ModuleType) -> dict[str, Any]:
    return routing.simulated(routing.parse_args(["--quick"]))


def test_every_turn_is_answered_and_measured_within_range(
    routing: ModuleType, quick: dict[str, Any]
) -> None:
    """Every policy answers every turn of the same sessions; hit rates lie in [0, 1],
    imbalances at 1 or above (exactly 1 for the one engine), TTFTs above 0."""
    for by_layout in quick.values():
        for cell in by_layout.values():
            turns = {cell[p]["mean"]["num_turns"] for p in (*routing.POLICIES, routing.REFERENCE)}
            assert len(turns) == 1
            for policy in (*routing.POLICIES, routing.REFERENCE):
                for run in cell[policy]["runs"]:
                    assert 0.0 <= run["hit_rate"] <= 1.0
                    assert run["imbalance"] >= 1.0
                    assert 0.0 < run["ttft_ms_p50"] <= run["ttft_ms_p90"]
            assert cell[routing.REFERENCE]["mean"]["imbalance"] == 1.0


def test_on_full_attention_both_prefix_routers_decide_alike(
    routing: ModuleType, quick: dict[str, Any]
) -> None:
    """With full attention alone, reading only the full-attention groups is reading them
    all: the two prefix routers (same weights) make the same run."""
    for by_layout in quick.values():
        cell = by_layout["full"]
        for suffix in routing.WEIGHTS:
            ours, theirs = (
                {
                    k: v
                    for k, v in cell[f"{p}{suffix}"]["mean"].items()
                    if k not in ("route_us", "wall_s")
                }
                for p in ("ours", "full-attention-only")
            )
            assert ours == theirs


def test_goals_are_checked_for_each_of_ours(routing: ModuleType, quick: dict[str, Any]) -> None:
    """Each ``ours`` row (the weights now and before; not the one blind to free pages)
    has the four goals on a hybrid layout, three on full attention."""
    for by_layout in quick.values():
        for layout, cell in by_layout.items():
            assert set(cell["goals"]) == {"ours", "ours, before"}
            for checks in cell["goals"].values():
                assert len(checks) == (3 if layout == "full" else 4)
