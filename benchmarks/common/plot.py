"""The docs' figures: ``benchmarks/results/*.json`` drawn as ``docs/img/*.png``.

Each figure is drawn from one results file, which the command beside it writes (the
file's ``command`` field repeats it); a file that is missing is reported and its figure
left as it is.

==========================  ==================================================================
``multisession.png``        ``multisession.json``: ``python -m benchmarks.allocator.multisession
                            --json benchmarks/results/multisession.json``; prefix hit rate
                            against occupancy, per layout and working-set definition
``pages_per_group.png``     ``pages_per_group.json``: ``hybridkv demo --plot pages.png``,
                            then its ``pages.json`` copied here; the pages each KV group
                            holds over the run (drawn as ``--plot`` draws it)
``capacity.png``            ``capacity.json``: ``python -m benchmarks.allocator.capacity --json
                            benchmarks/results/capacity.json``; requests that fit, hybrid
                            against uniform layout, at the largest budget
``vs_llama_cpp.png``        ``vs_llama_cpp.json``: ``python -m benchmarks.peers.vs_llama_cpp
                            --requests-per-stream 2 --json benchmarks/results/vs_llama_cpp.json``;
                            time to first token and inter-token latency against llama.cpp
==========================  ==================================================================

    python -m benchmarks.common.plot [--results DIR] [--out DIR]      (make figures)

Needs matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridkv.serving.cli.workload.plots import draw_pages_per_group, new_figure, save_figure

ROOT = Path(__file__).resolve().parents[2]
HYBRID, UNIFORM, OURS, THEIRS = "tab:blue", "tab:orange", "tab:blue", "tab:orange"


def multisession(results: dict[str, Any], path: Path) -> Path:
    """Prefix hit rate of turns 2 on against occupancy: a panel per working-set definition,
    a colour per layout, measured (solid) and the capacity estimate (dashed)."""
    workload = results["workload"]
    sets = results["working_sets"]
    figure = new_figure(10.0, 4.5)
    panels = figure.subplots(1, len(sets), sharey=True, squeeze=False)[0]
    for axes, (definition, rows) in zip(panels, sets.items(), strict=True):
        colours = iter(("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"))
        layouts: dict[str, str] = {}
        for label, row in rows.items():
            layout, _, allocator = label.rpartition(", ")
            colour = layouts.setdefault(layout, next(colours))
            occupancy = sorted(row, key=float)
            x = [float(o) for o in occupancy]
            axes.plot(x, [row[o]["hit_rate"] for o in occupancy], marker="o", color=colour,
                      label=f"{layout} ({allocator})")  # fmt: skip
            if allocator == "hybridkv":
                axes.plot(x, [row[o]["capacity_estimate"] for o in occupancy], linestyle="--",
                          color=colour, label=f"{layout}, capacity estimate")  # fmt: skip
        axes.set_title(f"working set: {definition}")
        axes.set_xlabel(f"occupancy ({definition} working set / pool pages)")
        axes.set_ylim(0, 1.05)
        axes.grid(alpha=0.3)
        axes.legend(loc="lower left", fontsize="small")
    panels[0].set_ylabel(f"prefix hit rate, turns 2-{workload['turns']}")
    figure.suptitle(
        f"Prefix cache under pressure: {workload['sessions']} chats x {workload['turns']} turns "
        f"round-robin, {workload['in_flight']} in flight, window {workload['window']}"
    )
    return save_figure(figure, path)


def pages_per_group(results: dict[str, Any], path: Path) -> Path:
    """The pages each KV group holds over a demo run, as ``hybridkv demo --plot`` draws it."""
    return draw_pages_per_group(results, path)


def capacity(results: dict[str, Any], path: Path) -> Path:
    """Requests that fit at the largest budget: a panel per request length, a pair of bars
    (hybrid, uniform) per model, on a log scale with the counts written on the bars."""
    configs = results["configs"]
    rows = [r for rs in configs.values() for r in rs]
    budget = max(rows, key=lambda r: r["budget_bytes"])["budget"]
    lengths = sorted({r["request_tokens"] for r in rows})
    figure = new_figure(11.0, 4.8)
    panels = figure.subplots(1, len(lengths), sharey=True, squeeze=False)[0]
    names = list(configs)
    for axes, tokens in zip(panels, lengths, strict=True):
        cells = [
            next(r for r in configs[n] if r["budget"] == budget and r["request_tokens"] == tokens)
            for n in names
        ]
        x = range(len(names))
        for offset, layout, colour in ((-0.2, "hybrid", HYBRID), (0.2, "uniform", UNIFORM)):
            counts = [c["requests"][layout] for c in cells]
            bars = axes.bar([i + offset for i in x], [max(n, 0.5) for n in counts], width=0.4,
                            color=colour, label=f"{layout} layout")  # fmt: skip
            axes.bar_label(bars, labels=[f"{n:,}" for n in counts], fontsize="x-small")
        axes.set_xticks(list(x), names, rotation=25, ha="right", fontsize="small")
        axes.set_yscale("log")
        axes.set_title(f"requests of {tokens:,} tokens")
        axes.grid(alpha=0.3, axis="y")
        axes.legend(loc="upper right", fontsize="small")
    panels[0].set_ylabel("requests that fit at once (count, log scale)")
    figure.suptitle(
        f"KV capacity in {budget} of {results['dtype']} KV: the planner's hybrid layout "
        "against every layer as full attention"
    )
    return save_figure(figure, path)


def vs_llama_cpp(results: dict[str, Any], path: Path) -> Path:
    """Time to first token and inter-token latency, hybridkv against llama.cpp, a pair of
    bars per workload, ours / theirs written above each pair."""
    workloads = results["workloads"]
    figure = new_figure(11.0, 4.8)
    panels = figure.subplots(1, 2, squeeze=False)[0]
    labels = [k.replace(" out, ", " out\n") for k in workloads]
    metrics = (("ttft_ms", "time to first token (ms, median)"),
               ("itl_ms", "inter-token latency (ms, median)"))  # fmt: skip
    for axes, (metric, title) in zip(panels, metrics, strict=True):
        x = range(len(workloads))
        for offset, who, colour, name in ((-0.2, "ours", OURS, "hybridkv"),
                                          (0.2, "theirs", THEIRS, "llama.cpp")):  # fmt: skip
            values = [w[metric][who] for w in workloads.values()]
            axes.bar([i + offset for i in x], values, width=0.4, color=colour, label=name)
        top = max(max(w[metric]["ours"], w[metric]["theirs"]) for w in workloads.values())
        for i, w in enumerate(workloads.values()):
            height = max(w[metric]["ours"], w[metric]["theirs"])
            axes.annotate(f"{w[metric]['ratio']:.2f}x", (i, height + 0.02 * top), ha="center",
                          va="bottom", fontsize="small")  # fmt: skip
        axes.set_ylim(0, 1.15 * top)
        axes.set_xticks(list(x), labels, fontsize="small")
        axes.set_title(title)
        axes.set_ylabel("milliseconds")
        axes.grid(alpha=0.3, axis="y")
        axes.legend(loc="upper left", fontsize="small")
    figure.suptitle(
        f"hybridkv serve against llama-server, same GGUF, {results['threads']} threads "
        f"(weights {results['weights']}); above the bars: ours / llama.cpp, lower is better"
    )
    return save_figure(figure, path)


FIGURES: dict[str, Callable[[dict[str, Any], Path], Path]] = {
    "multisession": multisession,
    "pages_per_group": pages_per_group,
    "capacity": capacity,
    "vs_llama_cpp": vs_llama_cpp,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    missing = []
    for name, draw in FIGURES.items():
        source = args.results / f"{name}.json"
        if not source.is_file():
            missing.append(source.name)
            continue
        png = draw(json.loads(source.read_text()), args.out / f"{name}.png")
        print(f"{source.name} -> {png.relative_to(ROOT) if png.is_relative_to(ROOT) else png}")
    if missing:
        print(f"no results for: {', '.join(missing)} (figures left as they are)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
