"""The summary table of a workload run: throughput, latency, prefix cache, pages, capacity."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from hybridkv.memory.layout import LayerSpec, LayoutPlan
from hybridkv.memory.layout_planner import describe, policy_label
from hybridkv.serving.cli.workload.run import WorkloadResult


def format_table(rows: Sequence[tuple[str, str]]) -> list[str]:
    """Two aligned columns."""
    width = max(len(label) for label, _ in rows)
    return [f"  {label.ljust(width)}  {value}" for label, value in rows]


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary_rows(
    result: WorkloadResult, plan: LayoutPlan, specs: Sequence[LayerSpec]
) -> list[tuple[str, str]]:
    """The rows of the summary: what ran, how fast, and what the hybrid layout bought."""
    records = result.records
    kinds: dict[str, int] = {}
    for r in records:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    prompt = sum(r.num_prompt_tokens for r in records)
    cached = sum(r.num_cached_tokens for r in records)
    output = sum(r.num_output_tokens for r in records)
    elapsed = max(result.elapsed_s, 1e-9)
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    rows = [
        ("requests", f"{len(records)} ({', '.join(f'{n} {k}' for k, n in kinds.items())})"),
        ("prompt tokens", f"{prompt:,} ({cached:,} served from the prefix cache)"),
        ("output tokens", f"{output:,}"),
        ("wall time", f"{result.elapsed_s:.1f} s"),
        (
            "throughput",
            f"{output / elapsed:.1f} output tokens/s, "
            f"{(prompt - cached + output) / elapsed:.0f} computed tokens/s",
        ),
    ]
    if ttfts:
        rows.append(
            (
                "time to first token",
                f"median {statistics.median(ttfts):.2f} s, p90 {_quantile(ttfts, 0.9):.2f} s",
            )
        )
    rows += [
        ("prefix-cache hit rate", f"{result.prefix_hit_rate:.1%}"),
        ("preemptions", str(result.num_preemptions)),
        (
            "KV pool",
            f"{plan.num_blocks:,} pages of {plan.block_size} tokens, "
            f"{len(plan.groups)} groups, {plan.pool_bytes / 2**20:,.0f} MiB",
        ),
    ]
    rows.append(("pages per group at peak", _peak_pages(plan, result.peak_blocks_per_group)))
    longest = max(r.num_prompt_tokens + r.num_output_tokens for r in records)
    for tokens in sorted({longest, max(longest, 8192)}):
        rows.append(capacity_row(plan, specs, tokens))
    return rows


def _peak_pages(plan: LayoutPlan, peak: Sequence[int]) -> str:
    """``full: 236 | sliding_window(window=512): 236 210 ...`` (groups of one policy
    together; state groups' pages are counted apart, as state pages)."""
    by_policy: dict[str, list[str]] = {}
    for group, num in zip(plan.groups, peak, strict=True):
        label = policy_label(group.policy)
        if group.policy.keeps_state:
            label += f" state pages of {plan.state_span}" if plan.state_span > 1 else " state"
        by_policy.setdefault(label, []).append(f"{num:,}")
    parts = [f"{label}: {' '.join(nums)}" for label, nums in by_policy.items()]
    return " | ".join(parts) + f" (of {plan.num_blocks - 1:,})"


def capacity_row(plan: LayoutPlan, specs: Sequence[LayerSpec], tokens: int) -> tuple[str, str]:
    """How many tokens of ``tokens``-long requests fit, hybrid against uniform."""
    report = describe(plan, specs, tokens)
    hybrid, uniform = report.max_requests, report.uniform_max_requests
    if hybrid is None or uniform is None or uniform == 0:
        return ("vs uniform allocator", "no full-attention baseline to compare")
    return (
        f"fit, {tokens:,}-token requests",
        f"{hybrid:,} requests ({hybrid * tokens:,} tokens) against {uniform:,} with a uniform "
        f"allocator: {hybrid / uniform:.2f}x",
    )
