"""Capacity of hybrid_cliffs.py: requests that fit, and bytes held over live bytes."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from benchmarks.common.layouts import GroupPage, Layout, group_pages
from benchmarks.hybrid.vllm_mamba import make_reference
from benchmarks.hybrid.workloads import GOAL_BLOCK, random_tokens
from hybridkv.memory import KVCacheManager
from hybridkv.memory.layout import (
    AttentionSpec,
    LayerSpec,
    LayoutPlan,
)
from hybridkv.memory.layout_planner import describe
from hybridkv.policies import MambaLike
from hybridkv.policies.base import cdiv

# -- 4. capacity ----------------------------------------------------------------------------


def live_bytes(specs: Sequence[LayerSpec], tokens: int, block_size: int = 1) -> int:
    """K/V of ``tokens`` (in pages of ``block_size``) and one state per state layer."""
    return sum(
        s.block_bytes(block_size) * cdiv(tokens, block_size)
        if isinstance(s, AttentionSpec)
        else s.block_bytes(block_size)
        for s in specs
    )


def capacity(
    layout: Layout,
    plan: LayoutPlan,
    specs: Sequence[LayerSpec],
    tokens: int,
    vllm: Any,
    budget: int,
) -> dict[str, Any]:
    """Requests of ``tokens`` that fit: the plan's report, the goal, measured admissions."""
    report = describe(plan, specs, tokens)
    pages = group_pages(plan, specs)
    held = sum(
        g.blocks_per_request * p.page_id_bytes for g, p in zip(report.groups, pages, strict=True)
    )
    live = live_bytes(specs, tokens)
    state_pages = MambaLike().max_live_blocks(tokens, GOAL_BLOCK)
    goal_held = sum(
        s.block_bytes(GOAL_BLOCK) * cdiv(tokens, GOAL_BLOCK)
        if isinstance(s, AttentionSpec)
        else s.block_bytes(GOAL_BLOCK) * state_pages
        for s in specs
    )
    out: dict[str, Any] = {
        "plan_fits": report.max_requests,
        "plan_held_bytes": held,
        "live_bytes": live,
        "plan_held_over_live": round(held / live, 2),
        "padding_fraction": round(report.padding_fraction, 3),
        "uniform_fits": report.uniform_max_requests,
        "goal_fits": (budget - max(p.page_id_bytes for p in pages)) // goal_held,
        "goal_held_bytes": goal_held,
        "goal_held_over_live": round(goal_held / live, 2),
        "admitted": admitted_ours(layout, tokens),
        "admitted_one_call": admitted_ours(layout, tokens, chunk=tokens)["requests"],
    }
    out["admitted_held_over_live"] = _held_over_live(out["admitted"], pages, live)
    out["waste_of_pool"] = _waste_of_pool(out["admitted"], pages, specs, plan, tokens)
    if vllm is not None:
        out["vllm_admitted"] = admitted_vllm(vllm, layout, tokens)
        out["vllm_admitted_held_over_live"] = _held_over_live(out["vllm_admitted"], pages, live)
    return out


def _waste_of_pool(
    admitted: dict[str, Any],
    pages: Sequence[GroupPage],
    specs: Sequence[LayerSpec],
    plan: LayoutPlan,
    tokens: int,
) -> float | None:
    """Bytes of the pages the admitted requests hold that hold nothing (page padding,
    the empty slots of partial K/V blocks, empty slots), over the pool's bytes.

    Content: every request's K/V of its ``tokens`` in each attention layer, and one
    state per state layer in each state page held (checkpoints count as content)."""
    n = admitted.get("requests")
    if not n:
        return None
    by_name = {s.name: s for s in specs}
    held = content = 0
    for group, num, page in zip(plan.groups, admitted["pages_per_group"], pages, strict=True):
        held += num * page.page_id_bytes
        for name in group.layer_names:
            spec = by_name[name]
            if isinstance(spec, AttentionSpec):
                content += n * spec.block_bytes(1) * tokens
            else:
                content += num * spec.block_bytes(1)
    return round((held - content) / plan.pool_bytes, 4)


def _held_over_live(admitted: dict[str, Any], pages: Sequence[GroupPage], live: int) -> Any:
    if "requests" not in admitted or not admitted["requests"]:
        return None
    held = sum(n * p.page_id_bytes for n, p in zip(admitted["pages_per_group"], pages, strict=True))
    return round(held / admitted["requests"] / live, 2)


class _Prompt:
    __slots__ = ("all_token_ids", "extra_keys", "request_id")

    def __init__(self, request_id: str, tokens: list[int]) -> None:
        self.request_id, self.all_token_ids = request_id, tokens
        self.extra_keys: tuple[object, ...] = ()


#: Tokens a prefill chunk allocates in the admission measure (the engine's step budget
#: in the other workloads).
CHUNK = 2048


def admitted_ours(layout: Layout, tokens: int, chunk: int = CHUNK) -> dict[str, Any]:
    """Requests of ``tokens`` unique tokens our manager holds at once, each prefilled in
    chunks of ``chunk`` tokens (``CHUNK``: as the engine runs it; ``tokens``: the whole
    prompt in one call, vLLM's measure) (each chunk's allocation releases
    what the previous chunk's step left dead: the checkpoints inside a long prompt), and
    the pages they hold per group."""
    pool = layout.pool
    manager = KVCacheManager.for_pool(pool)
    rng = random.Random(tokens)
    n = 0
    while True:
        request = _Prompt(str(n), random_tokens(rng, tokens))
        done = 0
        hit = manager.lookup(request)
        while done < tokens:
            num = min(chunk, tokens - done)
            if manager.allocate(request, num, hit if done == 0 else None) is None:
                break
            done += num
        if done < tokens:
            manager.free(request.request_id, computed=False)
            break
        n += 1
    per_group = [0] * len(pool.policies)
    for i in range(n):
        for g, table in enumerate(manager.block_tables(str(i))):
            per_group[g] += sum(1 for page in table if page)
    return {"requests": n, "pages_per_group": per_group}


def admitted_vllm(vllm: Any, layout: Layout, tokens: int) -> dict[str, Any]:
    """The same on vLLM's manager (its admission gate on: the whole prompt must fit)."""
    alloc, problem = make_reference(vllm, layout, tokens + 1)
    if alloc is None:
        return problem
    rng = random.Random(tokens)
    n = 0
    while True:
        alloc.add(n, random_tokens(rng, tokens))
        alloc.step_starts()
        alloc.lookup(n)
        if alloc.admit(n, tokens, True) is None:
            break
        n += 1
    per_group = [0] * len(layout.pool.policies)
    for i in range(n):
        for g, ids in enumerate(alloc.manager.get_block_ids(str(i))):
            per_group[g] += sum(1 for page in ids if page)
    return {"requests": n, "pages_per_group": per_group}
