"""benchmarks/routing/policies.py's simulated part: its quick run keeps the invariants of its
measures, and its faster index answers as the router's own."""

from __future__ import annotations

import json
from pathlib import Path
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


def test_the_ttft_goal_reports_the_ratio_seed_by_seed(
    routing: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """Against smg, the TTFT goal is judged on the means over seeds and also given as
    the ratio of each seed's pair, whose median one seed's load cannot drag: here the
    means fail (one bad seed) while the median is 1.1."""
    report = benchmark_module("benchmarks.routing.report")

    def runs(*ttfts: float) -> dict[str, Any]:
        measures = [
            {"hit_rate": 0.8, "ttft_ms_mean": t, "ttft_ms_p50": t, "ttft_ms_p90": t,
             "imbalance": 1.1, "preemptions": 0}
            for t in ttfts
        ]  # fmt: skip
        return {"runs": measures} | report.spread(measures)

    cell = {
        "ours": runs(44.0, 33.0, 300.0),
        report.SMG: runs(40.0, 30.0, 100.0),
        report.REFERENCE: runs(30.0, 30.0, 30.0),
    }
    cell["goals"] = report.goals(cell, False, ("ours", report.SMG))
    ttft = cell["goals"]["ours"]["TTFT <= 1.2x smg's"]
    assert ttft == {
        "met": False,
        "seeds_met": 2,
        "ratio": {"median": 1.1, "min": 1.1, "max": 3.0},
    }
    report.print_table({"4 real replicas": {"full": cell}}, ("ours", report.SMG))
    printed = capsys.readouterr().out
    assert "TTFT <= 1.2x smg's NO (2/3; by seed median 1.10 [1.10, 3.00])" in printed


def test_saved_real_runs_pool_seed_by_seed(tmp_path: Path) -> None:
    """Run alone, the report pools every seed of every saved real run where ours and smg
    ran side by side: two runs of two seeds each give four pairs."""
    report = benchmark_module("benchmarks.routing.report")

    def saved(name: str, ours: list[float], smg: list[float]) -> Path:
        def runs(ttfts: list[float]) -> dict[str, Any]:
            return {"runs": [{"ttft_ms_mean": t} for t in ttfts]}

        cell = {"ours": runs(ours), report.SMG: runs(smg), report.REFERENCE: runs(smg)}
        path = tmp_path / name
        path.write_text(json.dumps({"real": {"4 real replicas": {"full": cell}}}))
        return path

    paths = [
        saved("a.json", [10.0, 30.0], [10.0, 20.0]),
        saved("b.json", [11.0, 40.0], [10.0, 20.0]),
    ]
    assert report.pooled(paths) == {
        "seeds": 4,
        "ratio_of_means": 1.517,  # 91 over 60
        "median": 1.3,  # of 1.0, 1.1, 1.5 and 2.0
        "geometric_mean": 1.348,  # the fourth root of 3.3
        "min": 1.0,
        "max": 2.0,
        "seeds_met": 2,
    }
    with pytest.raises(SystemExit, match="no real run of 'least-loaded'"):
        report.pooled(paths, "least-loaded")
