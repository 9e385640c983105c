"""Figures: the pages each KV group holds over a run, and the matplotlib set-up they share.

``hybridkv demo --plot FILE`` and ``hybridkv bench --plot FILE`` save the chart of their
own run with :func:`save_pages_plot` (the PNG at FILE, its series as JSON beside it);
``benchmarks/common/plot.py`` draws the docs' figure from such a JSON with the same
:func:`draw_pages_per_group`, and its other figures on :func:`new_figure`.

matplotlib (the ``bench`` extra) is imported only when a figure is drawn, and drawn on
the Agg canvas straight, without pyplot, so no backend or display is ever chosen.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridkv.serving.cli.flags.values import UsageError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from hybridkv.memory.layout import LayoutPlan
    from hybridkv.serving.cli.workload.run import PagesSample

#: The ``format`` field of a pages-per-group series.
PAGES_FORMAT = "hybridkv-pages/1"


def require_matplotlib() -> None:
    """Raise a one-line :class:`UsageError` naming the ``bench`` extra if matplotlib is
    missing (call it before a long run whose end draws a figure)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(
            "drawing a figure needs matplotlib: pip install 'hybridkv[bench]'"
        ) from None


def check_plot_path(path: Path) -> None:
    """Refuse a ``--plot`` file the run could not write at its end, before the run."""
    if path.suffix.lower() == ".json":
        raise UsageError(
            f"--plot {str(path)!r}: name the PNG; its series is written beside it as .json"
        )
    if not path.parent.is_dir():
        raise UsageError(f"--plot {str(path)!r}: no folder {str(path.parent)!r}")


def new_figure(width: float = 8.0, height: float = 4.5) -> Figure:
    """A matplotlib figure (inches) on an Agg canvas."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def save_figure(figure: Figure, path: Path) -> Path:
    """Write ``figure`` as a PNG at exactly ``path``."""
    figure.savefig(path, format="png", dpi=100, metadata={"Software": None})
    return path


def pages_series(
    samples: Sequence[PagesSample], plan: LayoutPlan, *, title: str, source: str
) -> dict[str, Any]:
    """A run's pages per group as a JSON-ready series: one entry per KV group."""
    from hybridkv.memory.layout_planner import policy_label

    return {
        "format": PAGES_FORMAT,
        "title": title,
        "source": source,
        "block_size": plan.block_size,
        "pool_pages": plan.num_blocks - 1,  # the null page holds nothing
        "steps": [s.step for s in samples],
        "elapsed_s": [round(s.elapsed_s, 3) for s in samples],
        "groups": [
            {
                "group": group.group_id,
                "policy": policy_label(group.policy),
                "num_layers": len(group.layer_names),
                "pages": [s.blocks_per_group[group.group_id] for s in samples],
            }
            for group in plan.groups
        ],
    }


def save_pages_plot(path: Path, series: dict[str, Any]) -> tuple[Path, Path]:
    """The chart of ``series`` at ``path`` and the series at ``path`` with a .json suffix."""
    if not series["groups"] or not series["steps"]:
        raise UsageError("--plot: the run recorded no pages to draw")
    data = path.with_suffix(".json")
    draw_pages_per_group(series, path)
    data.write_text(json.dumps(series, indent=1) + "\n")
    return path, data


def draw_pages_per_group(series: dict[str, Any], path: Path) -> Path:
    """Above, a line per KV group of the pages it holds against the engine step; below,
    their sum, the pages taken from the one shared pool (and the pool, when near).

    Groups whose series are identical (groups of one policy serving the same requests)
    share one line and one legend entry, which names them all.
    """
    if series.get("format") != PAGES_FORMAT:
        raise UsageError(f"not a pages-per-group series ({PAGES_FORMAT}): {series.get('format')}")
    steps, pool = series["steps"], series["pool_pages"]
    figure = new_figure(8.0, 6.0)
    groups, pooled = figure.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    for label, pages in group_lines(series):
        groups.plot(steps, pages, drawstyle="steps-post", linewidth=1.6, label=label)
    groups.set_title(f"{series['title']}\npages of {series['block_size']} tokens")
    groups.set_ylabel("pages held per group")
    groups.legend(loc="upper left", fontsize="small")
    total = [sum(column) for column in zip(*(g["pages"] for g in series["groups"]), strict=True)]
    pooled.plot(steps, total, drawstyle="steps-post", color="black", linewidth=1.4,
                label=f"all groups (peak {max(total):,})")  # fmt: skip
    near = pool <= 1.5 * max(total)  # the pool is drawn only where it leaves the line readable
    if near:
        pooled.axhline(pool, color="grey", linestyle="--", linewidth=1.0, label="pool")
    pooled.set_title(f"all groups, from one pool of {pool:,} pages", fontsize="medium")
    pooled.set_ylabel("pages held")
    pooled.set_xlabel("engine step")
    pooled.legend(loc="upper left", fontsize="small")
    group_peak = max(max(g["pages"]) for g in series["groups"])
    for axes, top in ((groups, group_peak), (pooled, max(pool if near else 0, *total))):
        axes.set_ylim(0, max(1.0, 1.3 * top))  # room for the legend above the lines
        axes.grid(alpha=0.3)
    return save_figure(figure, path)


def group_lines(series: dict[str, Any]) -> list[tuple[str, list[int]]]:
    """(legend label, pages) per line: one per group, identical series sharing one."""
    lines: dict[tuple[int, ...], list[dict[str, Any]]] = {}
    for group in series["groups"]:
        lines.setdefault(tuple(group["pages"]), []).append(group)
    return [(_label(groups), list(pages)) for pages, groups in lines.items()]


def _label(groups: list[dict[str, Any]]) -> str:
    """``group 5: full, 3 layers``; ``groups 0-4: sliding...; group 5: full (3 layers each,
    the same pages)`` for groups sharing a line."""
    by_policy: dict[str, list[int]] = {}
    for g in groups:
        by_policy.setdefault(g["policy"], []).append(g["group"])
    names = "; ".join(
        f"{'group' if len(ids) == 1 else 'groups'} {_span(ids)}: {policy}"
        for policy, ids in by_policy.items()
    )
    layers = list(dict.fromkeys(g["num_layers"] for g in groups))
    noun = "layer" if layers == [1] else "layers"
    if len(groups) == 1:
        return f"{names}, {layers[0]} {noun}"
    each = (
        f"{layers[0]} {noun} each" if len(layers) == 1 else "/".join(map(str, layers)) + " layers"
    )
    return f"{names} ({each}, the same pages)"


def _span(ids: list[int]) -> str:
    if len(ids) > 2 and ids == list(range(ids[0], ids[0] + len(ids))):
        return f"{ids[0]}-{ids[-1]}"
    return ", ".join(map(str, ids))
