"""The tables hybrid_cliffs.py prints: the plans, then one table per workload."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from benchmarks.common.layouts import (
    MODELS,
    GroupPage,
    group_pages,
)
from benchmarks.hybrid.workloads import CAPACITY_TOKENS, GOAL_BLOCK, REPEAT_LENGTHS
from hybridkv.memory.layout import (
    LayerSpec,
    LayoutPlan,
)

# -- printing --------------------------------------------------------------------------------


def _problem(result: dict[str, Any]) -> str | None:
    """``refused: <vLLM's error>``, ``not driven: <why>``, ``error: <...>``, or None."""
    for key in ("refused", "not_driven", "error"):
        if key in result:
            return f"{key.replace('_', ' ')}: {result[key]}"
    return None


def describe_plan(name: str, plan: LayoutPlan, specs: Sequence[LayerSpec], asked: int) -> dict:
    pages = group_pages(plan, specs)
    kinds: dict[str, list[GroupPage]] = {}
    for page in pages:
        kinds.setdefault(page.policy, []).append(page)
    return {
        "model": name,
        "config": MODELS[name],
        "num_kv_layers": len(specs),
        "block_size_asked": asked,
        "block_sizes": sorted({p.block_size for p in pages}),
        "state_span": plan.state_span,
        "num_blocks": plan.num_blocks,
        "group_size": plan.group_size,
        "uniform_num_blocks": plan.uniform_num_blocks,
        "pool_bytes": plan.pool_bytes,
        "groups": [attrs.asdict(p) for p in pages],
        "page_sizes": {
            kind: {
                "groups": len(members),
                "block_sizes": sorted({p.block_size for p in members}),
                "slot_page_bytes": sorted({p.slot_bytes for p in members}),
                "page_id_bytes": sorted({p.page_id_bytes for p in members}),
                "content_bytes": sorted({p.content_bytes for p in members}),
            }
            for kind, members in kinds.items()
        },
    }


def _blocks(plan: dict[str, Any]) -> str:
    """``block 800``, or ``block 16, states 50 pages`` for a plan with two page sizes."""
    sizes = plan["block_sizes"]
    out = f"block{'s' if len(sizes) > 1 else ''} {'/'.join(map(str, sizes))}"
    return out + (f", state {plan['state_span']} pages" if plan["state_span"] > 1 else "")


def print_plans(plans: dict[str, dict[str, Any]]) -> None:
    """One line per kind of group: its block size and page bytes, each layout."""
    print(
        f"{'model, layout':<29}{'KV layers':>9}  {'groups':<22}{'page ids':>9}{'block':>7}"
        f"{'slot page B':>13}{'page id B':>13}  filled B (by the group's layers)"
    )
    for model, layouts in plans.items():
        for layout, p in layouts.items():
            _print_plan(f"{model}, {layout.replace('_', ' ')}", p)


def _print_plan(name: str, p: dict[str, Any]) -> None:
    """The rows of one layout: one per kind of group."""
    for i, (kind, v) in enumerate(p["page_sizes"].items()):
        layers = p["group_size"]
        head = f"{name:<29}{p['num_kv_layers']:>9}  " if i == 0 else f"{'':<40}"
        blocks = f"{p['num_blocks']:>9}" if i == 0 else f"{'':>9}"
        groups = f"{v['groups']} {kind} x {layers} slots"
        print(
            head + f"{groups:<22}{blocks}"
            f"{'/'.join(map(str, v['block_sizes'])):>7}"
            f"{'/'.join(f'{b:,}' for b in v['slot_page_bytes']):>13}"
            f"{'/'.join(f'{b:,}' for b in v['page_id_bytes']):>13}  "
            f"{' / '.join(f'{b:,}' for b in v['content_bytes'])}"
        )
    if any(b != p["block_size_asked"] for b in p["block_sizes"]):
        asked = p["block_size_asked"]
        print(f"{'':<40}{_blocks(p)}, raised from {asked} so a page holds a state")


def _print_rows(
    models: Sequence[str],
    plans: dict[str, dict[str, Any]],
    results: dict[str, dict[str, Any]],
    workload: str,
    vllm_label: str,
    width: int,
    cells: Callable[[dict[str, Any]], str],
) -> None:
    """One row per allocator and model of ``workload``'s hybrid layout: its ``cells``, or
    why it did not run."""
    for name in models:
        two, one = _blocks(plans[name]["two_level"]), _blocks(plans[name]["one_page"])
        runs, before = results[name][workload]["hybrid"], results[name][workload]["one_page"]
        lines = [(f"hybridkv two-level ({two})", runs["hybridkv"])]
        lines.append((f"hybridkv one page ({one})", before["hybridkv"]))
        if "vllm" in before:
            lines.append((f"{vllm_label} ({one})", before["vllm"]))
        for i, (label, res) in enumerate(lines):
            head = f"{name if i == 0 else '':<20}{label:<{width}}"
            print(head + (_problem(res) or cells(res)))


def print_report(
    args: argparse.Namespace,
    plans: dict[str, dict[str, Any]],
    results: dict[str, dict[str, Any]],
    vllm: Any,
    loaded: str,
    budget: int,
    chat_settings: dict[str, Any],
    elapsed: float,
) -> None:
    """Print every table of the run (the numbers ``--json`` writes)."""
    models = args.models
    vllm_label = f"vLLM {args.vllm_version}"

    print(
        f"hybrid cliffs: KV memory {args.kv_memory} ({budget:,} B), block size "
        f"{args.block_size} asked, bfloat16 K/V, float32 state; {loaded}"
    )
    if vllm is not None:
        print(
            "vLLM's mamba groups: MambaSpec, mamba_cache_mode 'align', one prefill checkpoint "
            "block (as its Mamba2 mixer declares), hashes per block (prefix_match_unit unset)"
        )
    print_plans(plans)
    width = 46

    print(f"\n1. first repeat of a prompt: tokens hit on the repeat ({args.output_tokens}-token "
          f"replies, one request at a time)")  # fmt: skip
    print(f"{'model':<20}{'layout':<{width}}" + "".join(f"{n:>7}" for n in REPEAT_LENGTHS))
    _print_rows(
        models, plans, results, "repeat", vllm_label, width,
        lambda res: "".join(f"{res['hits'][f'{n}.repeat']:>7}" for n in REPEAT_LENGTHS),
    )  # fmt: skip
    goal = [(n - 1) // GOAL_BLOCK * GOAL_BLOCK for n in REPEAT_LENGTHS]
    print(f"{'':<20}{'goal: (len - 1) // 16 * 16':<{width}}" + "".join(f"{g:>7}" for g in goal))

    n_req = args.requests
    per_hit = args.prefix_tokens // GOAL_BLOCK * GOAL_BLOCK
    print(
        f"\n2. vLLM #45238: {n_req} requests queued at once, a {args.prefix_tokens}-token "
        f"shared prefix, {args.suffix_tokens}-token unique suffixes, {args.output_tokens}-token "
        f"replies, {args.budget} tokens a step"
    )
    print(
        f"{'model':<20}{'layout':<{width}}{'requests hit':>14}{'tokens hit':>12}{'preempted':>11}"
    )
    _print_rows(
        models, plans, results, "shared_prefix", vllm_label, width,
        lambda res: f"{res['requests_hit']:>8} of {n_req:<3}{res['tokens_hit']:>12,}"
        f"{res['preemptions']:>11}",
    )  # fmt: skip
    goal_label = f"goal: all but one hit {per_hit}"
    print(f"{'':<20}{goal_label:<{width}}{n_req - 1:>8} of {n_req:<3}{(n_req - 1) * per_hit:>12,}")

    cs = chat_settings
    print(
        f"\n3. chat: {cs['sessions']} sessions x {cs['turns']} turns round-robin, "
        f"{cs['in_flight']} in flight, system {cs['system_tokens']}, messages "
        f"{cs['user_tokens'][0]}-{cs['user_tokens'][1]}, replies {cs['reply_tokens'][0]}-"
        f"{cs['reply_tokens'][1]}, {cs['budget']} tokens a step; prefix hit rate of turns 2+"
    )
    print(f"{'model':<20}{'layout':<{width + 8}}{'hybridkv':>10}{vllm_label:>14}{'preempted':>13}")
    for name in models:
        layouts = plans[name]
        for i, key in enumerate(("hybrid", "one_page", "uniform")):
            cell = results[name]["chat"][key]
            p = layouts["one_page" if key == "one_page" else "two_level"]
            blocks = cell["hybridkv"]["num_blocks"] if key == "uniform" else p["num_blocks"]
            label = {
                "hybrid": f"two-level ({_blocks(p)}, {blocks} ids)",
                "one_page": f"one page ({_blocks(p)}, {blocks} ids)",
                "uniform": f"full attention, uniform ({blocks} ids)",
            }[key]
            ours = cell["hybridkv"]
            theirs = cell.get("vllm")
            problem = _problem(theirs) if theirs is not None else None
            theirs_cell = "" if theirs is None else f"{theirs.get('hit_rate', 0):.3f}"
            pre = f"{ours['preemptions']}"
            if theirs is not None and problem is None:
                pre += f" / {theirs['preemptions']}"
            line = f"{name if i == 0 else '':<20}{label:<{width + 8}}{ours['hit_rate']:>10.3f}"
            print(line + (f"  {problem}" if problem else f"{theirs_cell:>14}{pre:>13}"))
    print(
        f"{'':<20}{'goal: whole conversation, 16-token':<{width + 8}}{cs['goal_hit_rate']:>10.3f}"
    )

    print(
        "\n4. requests that fit at once, bytes a request holds over its live bytes (K/V + one "
        "state per Mamba2 layer), and the pool's bytes that admitted requests hold as padding"
    )
    head = (
        f"{'model, layout':<30}{'tokens':>7}{'plan fits':>10}{'held/live':>10}{'admitted':>10}"
        f"{'held/live':>10}{'waste':>8}{'1 call':>8}{'vLLM 1 call':>12}{'held/live':>10}"
    )
    print(head)
    for name in models:
        for layout, key in (("two-level", "capacity"), ("one page", "capacity_one_page")):
            for i, tokens in enumerate(CAPACITY_TOKENS):
                c = results[name][key][str(tokens)]
                va = c.get("vllm_admitted", {})
                v_req = va.get("requests", "see below" if _problem(va) else "-")
                v_hl = c.get("vllm_admitted_held_over_live") or "-"
                waste = c.get("waste_of_pool")
                label = f"{name}, {layout}" if i == 0 else ""
                print(
                    f"{label:<30}{tokens:>7}{c['plan_fits']:>10}"
                    f"{c['plan_held_over_live']:>10.2f}{c['admitted']['requests']:>10}"
                    f"{c['admitted_held_over_live']:>10.2f}"
                    f"{'-' if waste is None else f'{waste:.1%}':>8}"
                    f"{c['admitted_one_call']:>8}{v_req:>12}{v_hl:>10}"
                )
    for name in models:
        for tokens in CAPACITY_TOKENS:
            cell = results[name]["capacity_one_page"][str(tokens)]
            problem = _problem(cell.get("vllm_admitted", {}))
            if problem:
                print(f"{vllm_label}, {name} at {tokens} tokens: {problem}")
    print(f"\nran in {elapsed:.0f} s")
