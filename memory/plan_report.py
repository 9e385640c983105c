"""What a layout plan buys: requests of a length that fit, against a uniform allocator.

``describe`` reports a :class:`~hybridkv.memory.layout.LayoutPlan` made by
``hybridkv.memory.layout_planner``: per group its pages per request and padding (a state
page counting the K/V pages it spans), per policy, and the capacity beside the uniform
layout (every layer as full attention in one group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from hybridkv.memory.errors import LayoutError
from hybridkv.memory.layout import KVGroup, LayerSpec, LayoutPlan
from hybridkv.policies.base import MemoryPolicy
from hybridkv.policies.builtin import FullAttention


def page_ids(group: KVGroup, span: int) -> int:
    """Page ids one page of ``group`` takes."""
    return span if group.policy.keeps_state else 1


def group_bytes(group: KVGroup, by_name: dict[str, LayerSpec], block_size: int) -> int:
    """Bytes one page of ``group`` holds, over its layers."""
    return sum(by_name[n].block_bytes(block_size) for n in group.layer_names)


def policy_label(policy: MemoryPolicy) -> str:
    """``sliding_window(window=512)``: the registry name and the parameters set."""
    params = ", ".join(f"{k}={v}" for k, v in attrs.asdict(policy).items() if v is not None)
    return f"{policy.name}({params})" if params else policy.name


@attrs.frozen(kw_only=True)
class GroupReport:
    """One group: its policy, layers, pages per request, the page ids and padding of each
    of its pages (a state page takes ``page_ids`` K/V pages)."""

    group_id: int
    policy: str
    num_layers: int
    blocks_per_request: int
    padding_bytes_per_block: int
    page_ids: int = 1
    keeps_state: bool = False


@attrs.frozen(kw_only=True)
class PolicyReport:
    """One family of equal policies: its groups and its pages per request (all groups)."""

    policy: str
    num_groups: int
    num_layers: int
    blocks_per_request: int
    page_ids_per_request: int = 0


@attrs.frozen(kw_only=True)
class PlanReport:
    """What a plan holds for requests of ``request_tokens`` tokens, against uniform.

    The metric is the number of concurrent requests of L tokens (prompt and output) the
    pool holds at their peak, each group holding ``policy.max_live_blocks(L)`` pages (a
    state page counting the K/V pages it spans: ``blocks_per_request`` is in page ids), with
    no prefix sharing; the uniform allocator holds ``cdiv(L, block_size)`` pages per
    request. ``max_request_tokens`` is the longest single request. None means unbounded
    (an attention-free model, or only bounded policies such as windows and states).
    """

    request_tokens: int
    groups: tuple[GroupReport, ...]
    policies: tuple[PolicyReport, ...]
    stage_slots: tuple[int, ...]
    blocks_per_request: int
    uniform_blocks_per_request: int
    max_requests: int | None
    uniform_max_requests: int | None
    max_request_tokens: int | None
    uniform_max_request_tokens: int | None
    padding_fraction: float

    @property
    def gain(self) -> float | None:
        """Concurrent requests of L tokens, hybrid over uniform (None when undefined)."""
        if self.max_requests is None or not self.uniform_max_requests:
            return None
        return self.max_requests / self.uniform_max_requests


#: Longest request the report searches for; a plan holding it is reported unbounded.
_SEARCH_TOKENS = 1 << 40


def describe(plan: LayoutPlan, specs: Sequence[LayerSpec], request_tokens: int) -> PlanReport:
    """Report what ``plan`` (made from ``specs``) holds for requests of ``request_tokens``.

    ``padding_fraction`` is the share of pool bytes held by such requests that is padding
    (empty slots and page-size padding), each page weighted by how many the group holds.
    """
    if request_tokens < 1:
        raise LayoutError(f"request_tokens must be >= 1, got {request_tokens}")
    bs, by_name = plan.block_size, {s.name: s for s in specs}
    stage_slots = tuple(
        max((plan.layer_slots[n][1] + 1 for n in stage), default=0) for stage in plan.stages
    )
    slot_bytes = sum(stage_slots) * plan.block_bytes
    span = plan.state_span
    groups = tuple(
        GroupReport(
            group_id=g.group_id,
            policy=policy_label(g.policy),
            num_layers=len(g.layer_names),
            blocks_per_request=g.policy.max_live_blocks(request_tokens, bs),
            padding_bytes_per_block=page_ids(g, span) * slot_bytes - group_bytes(g, by_name, bs),
            page_ids=page_ids(g, span),
            keeps_state=g.policy.keeps_state,
        )
        for g in plan.groups
    )
    families: dict[str, list[GroupReport]] = {}
    for report in groups:
        families.setdefault(report.policy, []).append(report)
    policies = tuple(
        PolicyReport(
            policy=label,
            num_groups=len(members),
            num_layers=sum(r.num_layers for r in members),
            blocks_per_request=sum(r.blocks_per_request for r in members),
            page_ids_per_request=sum(r.blocks_per_request * r.page_ids for r in members),
        )
        for label, members in families.items()
    )
    hybrid_need = sum(r.blocks_per_request * r.page_ids for r in groups)
    uniform = FullAttention()
    uniform_need = uniform.max_live_blocks(request_tokens, bs) if plan.groups else 0
    used = hybrid_need * slot_bytes
    wasted = sum(r.blocks_per_request * r.padding_bytes_per_block for r in groups)

    def hybrid_blocks(n: int) -> int:
        return sum(g.policy.max_live_blocks(n, bs) * page_ids(g, span) for g in plan.groups)

    return PlanReport(
        request_tokens=request_tokens,
        groups=groups,
        policies=policies,
        stage_slots=stage_slots,
        blocks_per_request=hybrid_need,
        uniform_blocks_per_request=uniform_need,
        max_requests=_fits(plan.num_blocks, hybrid_need),
        uniform_max_requests=_fits(plan.uniform_num_blocks, uniform_need),
        max_request_tokens=_longest(plan.num_blocks, hybrid_blocks, bool(plan.groups)),
        uniform_max_request_tokens=_longest(
            plan.uniform_num_blocks, lambda n: uniform.max_live_blocks(n, bs), bool(plan.groups)
        ),
        padding_fraction=wasted / used if used else 0.0,
    )


def _fits(num_blocks: int, need: int) -> int | None:
    """Requests of ``need`` pages each that fit beside the null block (None: unbounded)."""
    return None if need == 0 else max(num_blocks - 1, 0) // need


def _longest(num_blocks: int, need: Callable[[int], int], has_kv: bool) -> int | None:
    """The largest token count whose pages fit beside the null block (None: unbounded)."""
    free = max(num_blocks - 1, 0)
    if not has_kv or need(_SEARCH_TOKENS) <= free:
        return None
    lo, hi = 0, _SEARCH_TOKENS  # need(lo) fits (0 tokens need nothing), need(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if need(mid) <= free:
            lo = mid
        else:
            hi = mid
    return lo
