"""routing.py's report: the spread over seeds, the issue's goals, the printed tables.

Run alone, it pools the real runs of several saved results (``policies.py --json``)::

    python -m benchmarks.routing.report RESULTS.json [RESULTS.json ...] [--policy ours]

and prints that policy's TTFT over smg's across every seed where both ran side by side:
the ratio of the means, the median and geometric mean of the seeds' ratios, and the
seeds within the goal. One run's ten seeds move with the machine's load of those minutes;
runs made on different days pooled move less.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: The reference every router is held to: one engine with all the replicas' pool.
REFERENCE = "one engine"
#: SGLang's gateway in the real runs: the time to first token the front end is held to.
SMG = "smg cache-aware"
#: The most the front end's TTFT may be over smg's, and the goal's name.
TTFT_GOAL = 1.2
TTFT_CHECK = f"TTFT <= {TTFT_GOAL:g}x smg's"


def spread(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean, min and max over seeds of each measure."""
    return {
        "mean": {k: round(statistics.fmean(r[k] for r in runs), 4) for k in runs[0]},
        "min": {k: min(r[k] for r in runs) for k in runs[0]},
        "max": {k: max(r[k] for r in runs) for k in runs[0]},
    }


def goals(cell: dict[str, Any], is_hybrid: bool, policies: tuple[str, ...]) -> dict[str, Any]:
    """The issue's goals for each ``ours`` in one scale and layout: met on the means over
    seeds, and in how many seeds (a goal whose baseline did not run is left out); the
    TTFT against smg's also seed by seed (:func:`seed_ratios`, :func:`ttft_ratio`)."""

    def checks(ours: str, run: int | None) -> dict[str, bool]:
        def m(policy: str, key: str = "hit_rate") -> float:
            entry = cell[policy]
            return float(entry["mean"][key] if run is None else entry["runs"][run][key])

        baseline = ours.replace("ours", "full-attention-only")
        out = {
            "within 0.05 of one engine": m(ours) >= m(REFERENCE) - 0.05,
            "imbalance < 1.25": m(ours, "imbalance") < 1.25,
        }
        if "round-robin" in cell:
            out[">= 1.5x round-robin"] = m(ours) >= 1.5 * m("round-robin")
        if SMG in cell and "ttft_ms_mean" in cell[SMG]["mean"]:
            out[TTFT_CHECK] = m(ours, "ttft_ms_mean") <= TTFT_GOAL * m(SMG, "ttft_ms_mean")
        if is_hybrid and baseline in cell:
            out["> full-attention-only"] = m(ours) > m(baseline)
        return out

    out: dict[str, Any] = {}
    for ours in (p for p in policies if p in ("ours", "ours, before")):
        per_seed = [checks(ours, i) for i in range(len(cell[ours]["runs"]))]
        out[ours] = {
            name: {"met": met, "seeds_met": sum(s[name] for s in per_seed)}
            for name, met in checks(ours, None).items()
        }
        if TTFT_CHECK in out[ours]:
            out[ours][TTFT_CHECK]["ratio"] = ttft_ratio(seed_ratios(cell, ours))
    return out


def seed_ratios(cell: dict[str, Any], ours: str) -> list[float]:
    """``ours``'s TTFT over smg's, seed by seed (each pair ran side by side)."""
    return [
        mine["ttft_ms_mean"] / theirs["ttft_ms_mean"]
        for mine, theirs in zip(cell[ours]["runs"], cell[SMG]["runs"], strict=True)
    ]


def ttft_ratio(ratios: list[float]) -> dict[str, float]:
    """The median of :func:`seed_ratios` and their extremes: a machine's load in one
    seed moves the median less than the mean."""
    return {
        "median": round(statistics.median(ratios), 3),
        "min": round(min(ratios), 3),
        "max": round(max(ratios), 3),
    }


def _ratio(ratio: dict[str, float]) -> str:
    return f"; by seed median {ratio['median']:.2f} [{ratio['min']:.2f}, {ratio['max']:.2f}]"


def _real_measures(m: dict[str, float]) -> str:
    """A real run's extra columns: the TTFT at the replicas (the rest of the clients' is
    the front end's and the transport's) and the front end's CPU seconds."""
    if "replica_ttft_ms_mean" not in m:
        return ""
    at_replicas, cpu = m["replica_ttft_ms_mean"], m["front_end_cpu_s"]
    return f"   at replicas {at_replicas:>4.0f}   front end CPU {cpu:.2f} s"


def print_table(results: dict[str, dict[str, dict[str, Any]]], policies: tuple[str, ...]) -> None:
    """One block per scale and layout: a row per policy, then the goals."""
    head = (
        f"{'policy':<27}{'hit rate':>21}{'TTFT mean':>11}{'p50':>6}{'p90':>6}"
        f"{'imbalance':>19}{'preempt':>9}"
    )
    for scale, by_layout in results.items():
        for layout, cell in by_layout.items():
            num_seeds = len(cell[REFERENCE]["runs"])
            print(f"\n== {scale}, {layout} ({num_seeds} seeds: mean [min, max])\n{head}")
            for policy in (*policies, REFERENCE):
                m, lo, hi = (cell[policy][k] for k in ("mean", "min", "max"))
                print(
                    f"{policy:<27}"
                    f"{m['hit_rate']:>7.3f} [{lo['hit_rate']:.3f}, {hi['hit_rate']:.3f}]"
                    f"{m['ttft_ms_mean']:>11.0f}{m['ttft_ms_p50']:>6.0f}{m['ttft_ms_p90']:>6.0f}"
                    f"{m['imbalance']:>7.2f} [{lo['imbalance']:.2f}, {hi['imbalance']:.2f}]"
                    f"{m['preemptions']:>9.0f}" + _real_measures(m)
                )
            for ours, checks in cell["goals"].items():
                met = [
                    f"{name} {'yes' if g['met'] else 'NO'} ({g['seeds_met']}/{num_seeds}"
                    + (_ratio(g["ratio"]) if "ratio" in g else "")
                    + ")"
                    for name, g in checks.items()
                ]
                print(f"goals, {ours}: " + "; ".join(met))


def pooled(paths: Sequence[Path], ours: str = "ours") -> dict[str, Any]:
    """``ours``'s TTFT over smg's in every real cell of the results at ``paths`` where
    both ran, seed by seed."""
    cells = [
        cell
        for path in paths
        for by_layout in json.loads(Path(path).read_text())["real"].values()
        for cell in by_layout.values()
        if ours in cell and SMG in cell
    ]
    if not cells:
        raise SystemExit(f"no real run of {ours!r} beside {SMG!r} in {', '.join(map(str, paths))}")
    ratios = [ratio for cell in cells for ratio in seed_ratios(cell, ours)]

    def mean(policy: str) -> float:
        return statistics.fmean(
            run["ttft_ms_mean"] for cell in cells for run in cell[policy]["runs"]
        )

    return {
        "seeds": len(ratios),
        "ratio_of_means": round(mean(ours) / mean(SMG), 3),
        "geometric_mean": round(statistics.geometric_mean(ratios), 3),
        "seeds_met": sum(r <= TTFT_GOAL for r in ratios),
    } | ttft_ratio(ratios)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="the TTFT against smg's, pooled over saved runs")
    p.add_argument("results", nargs="+", type=Path, help="policies.py --json files")
    p.add_argument("--policy", default="ours", help="whose TTFT (default: ours)")
    args = p.parse_args(argv)
    print(json.dumps(pooled(args.results, args.policy)))


if __name__ == "__main__":
    main()
