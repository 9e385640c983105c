"""The layout planner: per-layer specs and a byte budget in, a :class:`LayoutPlan` out.

Steps, in order:

1. **Families.** Layers with equal policies (``SlidingWindow(512) == SlidingWindow(512)``)
   form one family, in order of first appearance; each keeps its layers in model order.
2. **Group size** (layers per group). The candidates are the families' layer counts; the
   planner takes the one that leaves the fewest empty slots, and on a tie the larger one
   (fewer groups, fewer block tables). Gemma-3-like 4 full + 22 sliding gives 4 (2 empty
   slots, not 18); 10 full + 11 sliding gives 11 (1 empty slot, not 9).
3. **Groups.** A family of m layers gets ``g = cdiv(m, group_size)`` groups, group i
   holding ``layers[i::g]``. Striding, rather than cutting runs, keeps pipeline stages
   balanced (seed 000): stage 0 {full.0, sw.0, sw.1}, stage 1 {full.1, sw.2, sw.3} gives
   (full.0, full.1), (sw.0, sw.2), (sw.1, sw.3), so each stage holds one layer per group.
4. **Page size.** One page size for all: the largest layer page. Smaller attention pages
   are padded. A mamba-like state larger than the attention page raises the block size to
   the smallest multiple of the requested one whose attention page holds the state (as
   vLLM does), and the state is padded up to that page; past ``max_block_size`` the layers
   cannot share a page size and :class:`LayoutError` says so.
5. **Slots and N.** ``budget_bytes`` is the KV memory of one device. Each pipeline stage
   gives its layers of a group slots 0, 1, ... and allocates one slot tensor per slot it
   uses; ``group_size`` of the plan is the largest stage's count (the layers per group
   without stages). ``num_blocks = budget // (group_size * block_bytes)``, page 0 being
   the null block, and it must be at least 1 + the number of groups.

An attention-free model (no specs) gets a plan with no groups, ``group_size`` 0 and
``num_blocks`` 0: there is nothing to allocate. A stage with no KV layers allocates
nothing and does not limit N.

``padding_bytes`` is an upper bound: ``num_blocks`` times the padding in one page id of
the most padded group, over every stage's slot tensors (:func:`describe` weighs it by use).

The uniform baseline puts every layer, as full attention with its own page size, in one
group: per device, ``budget // sum of the page bytes of the stage's layers``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from hybridkv.memory.errors import LayoutError
from hybridkv.memory.layout import KVGroup, LayerSpec, LayoutPlan, StateSpec
from hybridkv.policies.base import MemoryPolicy, cdiv
from hybridkv.policies.builtin import FullAttention

#: Largest block the planner may choose to fit a mamba-like state into an attention page.
MAX_BLOCK_SIZE = 4096


def plan_layout(
    specs: Sequence[LayerSpec],
    budget_bytes: int,
    block_size: int = 16,
    *,
    stages: Sequence[Sequence[str]] | None = None,
    max_block_size: int = MAX_BLOCK_SIZE,
) -> LayoutPlan:
    """Plan groups, page size and pool size for ``specs`` in ``budget_bytes`` per device.

    Args:
        specs: One spec per KV layer, in model order (layers without KV are left out).
        budget_bytes: KV memory of one device (of each pipeline stage).
        block_size: Tokens per block asked for; a mamba-like state may raise it.
        stages: Per pipeline stage, the names of the layers it holds; None is one stage.
        max_block_size: The most tokens per block the planner may choose.

    Raises:
        LayoutError: bad specs or stages, layers that cannot share a page size, or a
            budget below one block per group plus the null block.
    """
    _check_inputs(specs, budget_bytes, block_size)
    names = [s.name for s in specs]
    stage_names = _check_stages(names, stages)
    if not specs:
        return LayoutPlan(
            block_size=block_size, num_blocks=0, block_bytes=0, groups=(), group_size=0,
            layer_slots={}, budget_bytes=budget_bytes, padding_bytes=0,
            uniform_num_blocks=0, stages=stage_names,
        )  # fmt: skip
    block_size = _unified_block_size(specs, block_size, max_block_size)
    block_bytes = max(s.block_bytes(block_size) for s in specs)
    groups = _build_groups(specs)
    stage_of = {n: i for i, stage in enumerate(stage_names) for n in stage}
    layer_slots, stage_slots = _assign_slots(groups, stage_of, len(stage_names))
    group_size = max(stage_slots)
    num_blocks = budget_bytes // (group_size * block_bytes)
    if num_blocks < 1 + len(groups):
        need = (1 + len(groups)) * group_size * block_bytes
        raise LayoutError(
            f"budget_bytes={budget_bytes} holds {num_blocks} blocks of {group_size} slots x "
            f"{block_bytes} bytes; {len(groups)} groups need at least {1 + len(groups)} "
            f"blocks (the null block included), so at least {need} bytes"
        )
    by_name = {s.name: s for s in specs}
    slot_bytes = sum(stage_slots) * block_bytes  # one page id, over every stage's tensors
    worst = max(slot_bytes - sum(by_name[n].block_bytes(block_size) for n in g.layer_names)
                for g in groups)  # fmt: skip
    # A uniform allocator gives every layer of a stage a page for every block.
    uniform_need = max(sum(by_name[n].block_bytes(block_size) for n in st) for st in stage_names)
    return LayoutPlan(
        block_size=block_size,
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        groups=groups,
        group_size=group_size,
        layer_slots=layer_slots,
        budget_bytes=budget_bytes,
        padding_bytes=num_blocks * worst,
        uniform_num_blocks=budget_bytes // uniform_need,
        stages=stage_names,
    )


def _check_inputs(specs: Sequence[LayerSpec], budget_bytes: int, block_size: int) -> None:
    for value, label in ((budget_bytes, "budget_bytes"), (block_size, "block_size")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise LayoutError(f"{label} must be an int, got {value!r}")
    if budget_bytes < 0:
        raise LayoutError(f"budget_bytes must be >= 0, got {budget_bytes}")
    if block_size < 1:
        raise LayoutError(f"block_size must be >= 1, got {block_size}")
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec.policy, MemoryPolicy):
            raise LayoutError(
                f"layer {spec.name!r} has policy {spec.policy!r}, not a MemoryPolicy; "
                "build one with hybridkv.policies.make_policy"
            )
        if not spec.name or spec.name in seen:
            raise LayoutError(f"layer names must be unique and non-empty, got {spec.name!r}")
        seen.add(spec.name)


def _check_stages(
    names: list[str], stages: Sequence[Sequence[str]] | None
) -> tuple[tuple[str, ...], ...]:
    """Stages as tuples, each KV layer in exactly one (one stage of all when None)."""
    if stages is None:
        return (tuple(names),)
    if not stages:
        raise LayoutError("stages must list at least one stage, got none")
    out = tuple(tuple(stage) for stage in stages)
    listed = [n for stage in out for n in stage]
    unknown = sorted(set(listed) - set(names))
    if unknown:
        raise LayoutError(f"stages name layers with no spec: {unknown}")
    twice = sorted({n for n in listed if listed.count(n) > 1})
    if twice:
        raise LayoutError(f"stages list layers more than once: {twice}")
    missing = [n for n in names if n not in set(listed)]
    if missing:
        raise LayoutError(f"layers in no stage: {missing}")
    return out


def _unified_block_size(specs: Sequence[LayerSpec], block_size: int, limit: int) -> int:
    """The block size at which the largest attention page holds the largest state."""
    states = [s for s in specs if isinstance(s, StateSpec)]
    attention = [s for s in specs if not isinstance(s, StateSpec)]
    if not states or not attention:
        return block_size
    state = max(states, key=lambda s: s.state_bytes)
    attn_page = max(s.block_bytes(block_size) for s in attention)
    # Attention pages grow linearly with the block; states do not.
    unified = block_size * cdiv(state.state_bytes, attn_page)
    if unified > limit:
        raise LayoutError(
            f"layers cannot share a page size: state of {state.name!r} ({state.state_bytes} "
            f"bytes) needs blocks of {unified} tokens for the attention page "
            f"({attn_page} bytes per {block_size} tokens) to hold it; max_block_size={limit}"
        )
    return unified


def choose_group_size(counts: Sequence[int]) -> int:
    """Layers per group: the family count leaving fewest empty slots, larger on a tie."""
    if not counts:
        return 0

    def empty_slots(size: int) -> int:
        return sum(cdiv(m, size) * size - m for m in counts)

    return min(set(counts), key=lambda size: (empty_slots(size), -size))


def _build_groups(specs: Sequence[LayerSpec]) -> tuple[KVGroup, ...]:
    families: dict[MemoryPolicy, list[str]] = {}
    for spec in specs:
        families.setdefault(spec.policy, []).append(spec.name)
    size = choose_group_size([len(layers) for layers in families.values()])
    groups: list[KVGroup] = []
    for policy, layers in families.items():
        num_groups = cdiv(len(layers), size)
        for i in range(num_groups):
            groups.append(
                KVGroup(
                    group_id=len(groups), policy=policy, layer_names=tuple(layers[i::num_groups])
                )
            )
    return tuple(groups)


def _assign_slots(
    groups: Sequence[KVGroup], stage_of: dict[str, int], num_stages: int
) -> tuple[dict[str, tuple[int, int]], list[int]]:
    """Layer -> (group, slot within its stage), and the slot tensors of each stage."""
    layer_slots: dict[str, tuple[int, int]] = {}
    stage_slots = [0] * num_stages
    for group in groups:
        used = [0] * num_stages
        for name in group.layer_names:
            stage = stage_of[name]
            layer_slots[name] = (group.group_id, used[stage])
            used[stage] += 1
        stage_slots = [max(a, b) for a, b in zip(stage_slots, used, strict=True)]
    return layer_slots, stage_slots


# -- what the plan buys -------------------------------------------------------------------


def policy_label(policy: MemoryPolicy) -> str:
    """``sliding_window(window=512)``: the registry name and the parameters set."""
    params = ", ".join(f"{k}={v}" for k, v in attrs.asdict(policy).items() if v is not None)
    return f"{policy.name}({params})" if params else policy.name


@attrs.frozen(kw_only=True)
class GroupReport:
    """One group: its policy, layers, pages per request and padding per page."""

    group_id: int
    policy: str
    num_layers: int
    blocks_per_request: int
    padding_bytes_per_block: int


@attrs.frozen(kw_only=True)
class PolicyReport:
    """One family of equal policies: its groups and its pages per request (all groups)."""

    policy: str
    num_groups: int
    num_layers: int
    blocks_per_request: int


@attrs.frozen(kw_only=True)
class PlanReport:
    """What a plan holds for requests of ``request_tokens`` tokens, against uniform.

    The metric is the number of concurrent requests of L tokens (prompt and output) the
    pool holds at their peak, each group holding ``policy.max_live_blocks(L)`` pages, with
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
    groups = tuple(
        GroupReport(
            group_id=g.group_id,
            policy=policy_label(g.policy),
            num_layers=len(g.layer_names),
            blocks_per_request=g.policy.max_live_blocks(request_tokens, bs),
            padding_bytes_per_block=slot_bytes
            - sum(by_name[n].block_bytes(bs) for n in g.layer_names),
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
        )
        for label, members in families.items()
    )
    hybrid_need = sum(r.blocks_per_request for r in groups)
    uniform = FullAttention()
    uniform_need = uniform.max_live_blocks(request_tokens, bs) if plan.groups else 0
    used = sum(r.blocks_per_request for r in groups) * slot_bytes
    wasted = sum(r.blocks_per_request * r.padding_bytes_per_block for r in groups)

    def hybrid_blocks(n: int) -> int:
        return sum(g.policy.max_live_blocks(n, bs) for g in plan.groups)

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
