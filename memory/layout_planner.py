"""The layout planner: per-layer specs and a byte budget in, a :class:`LayoutPlan` out.

Steps, in order:

1. **Families.** Layers with equal policies (``SlidingWindow(512) == SlidingWindow(512)``)
   form one family, in order of first appearance; each keeps its layers in model order.
2. **Group size** (slots per group). A family whose layers' K/V pages are a k-th of the
   largest (Gemma 4 31B's full layers: half its sliding ones') packs k layers side by side
   in one slot (``layer_offsets``), so m layers take ``cdiv(m, k)`` slots; other pages
   that do not divide the largest are padded to it (k = 1). A family of states takes the
   slots its bytes fill (step 4). The candidates are the families' slot counts; the
   planner takes the one that leaves the fewest empty slots,
   and on a tie the larger one (fewer groups, fewer block tables). Gemma-3-like 4 full +
   22 sliding gives 4 (2 empty slots, not 18); 10 full + 11 sliding gives 11 (1 empty
   slot, not 9).
3. **Groups.** A family of m layers in s slots gets ``g = cdiv(s, group_size)`` groups
   (states: as many as state pages of ``group_size`` slots need), group i holding
   ``layers[i::g]``. Striding, rather than cutting runs, keeps pipeline
   stages balanced (seed 000): stage 0 {full.0, sw.0, sw.1}, stage 1 {full.1, sw.2, sw.3}
   gives (full.0, full.1), (sw.0, sw.2), (sw.1, sw.3), so each stage holds one layer per
   group.
4. **Page sizes.** Two: the K/V page is the largest attention layer's page at the block
   size asked for (smaller attention pages are packed or padded), and a state page is the smallest
   number of K/V pages that holds the largest state (``state_span``; 1 where a state fits
   a K/V page), carved from the same pool (``hybridkv.memory.spans``). No group's page
   forces another group's block size. A page id holds its page of every slot side by
   side (``executor/kv_caches.py``), so a group's state page is one run of ``span x
   slots`` pages, its states one after another in it (``layer_offsets``), a state
   running on from one slot into the next; a family of states takes the slots its bytes
   fill. Where that pads as much as :data:`PADDING_GOAL`, a longer span may pad less
   (:func:`_choose_span`): Jamba's 28 states of 9.5 K/V pages waste 5% over 10 pages a
   slot, 2.2% over 17, in four groups instead of seven.
   With ``unify_page_size`` the planner does what a single page size forces instead (as
   vLLM does): it raises the block size to the smallest multiple of the requested one
   whose attention page holds the state, pads the state up to that page, and past
   ``max_block_size`` says so with :class:`LayoutError`.
5. **Slots and N.** ``budget_bytes`` is the KV memory of one device. Each pipeline stage
   gives its layers of a group slots 0, 1, ... (k layers to a slot where they pack) and
   allocates the slots it uses; ``group_size`` of the plan is the largest
   stage's count (the slots per group without stages).
   ``num_blocks = budget // (group_size * block_bytes)``, page 0 being the null block,
   rounded down to a multiple of ``state_span``; it must hold the null page's span, one
   state page per state group and one K/V page per K/V group.

An attention-free model (no specs) gets a plan with no groups, ``group_size`` 0 and
``num_blocks`` 0: there is nothing to allocate. A stage with no KV layers allocates
nothing and does not limit N.

``padding_bytes`` is an upper bound: ``num_blocks`` times the padding in one page id of
the most padded group, over every stage's slots (:func:`describe` weighs it by use).

The uniform baseline puts every layer, as full attention with its own page size, in one
group: per device, ``budget // sum of the page bytes of the stage's layers``.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.memory.errors import LayoutError
from hybridkv.memory.layout import KVGroup, LayerSpec, LayoutPlan, StateSpec, owns_pages, page_owner
from hybridkv.memory.packing import Packing, choose_group_size
from hybridkv.memory.plan_report import (
    GroupReport,
    PlanReport,
    PolicyReport,
    describe,
    group_bytes,
    page_ids,
    policy_label,
)
from hybridkv.policies.base import MemoryPolicy, cdiv

__all__ = [
    "MAX_BLOCK_SIZE",
    "GroupReport",
    "PlanReport",
    "PolicyReport",
    "choose_group_size",
    "describe",
    "plan_layout",
    "policy_label",
]

#: Largest block the planner may choose to fit a mamba-like state into an attention page.
MAX_BLOCK_SIZE = 4096

#: The share of state bytes the planner lets padding take before it packs states (below).
PADDING_GOAL = 0.05

#: How many times the least span a packed state span may be.
_LONGEST_SPAN = 8


def plan_layout(
    specs: Sequence[LayerSpec],
    budget_bytes: int,
    block_size: int = 16,
    *,
    stages: Sequence[Sequence[str]] | None = None,
    max_block_size: int = MAX_BLOCK_SIZE,
    unify_page_size: bool = False,
) -> LayoutPlan:
    """Plan groups, page size and pool size for ``specs`` in ``budget_bytes`` per device.

    Args:
        specs: One spec per KV layer, in model order (layers without KV are left out, and
            so are those reading another layer's pages: ``AttentionSpec.reads``).
        budget_bytes: KV memory of one device (of each pipeline stage).
        block_size: Tokens per block, for every group.
        stages: Per pipeline stage, the names of the layers it holds; None is one stage.
        max_block_size: With ``unify_page_size``, the most tokens per block the planner
            may raise the block size to.
        unify_page_size: One page size for every group, the block size raised until an
            attention page holds a state (today's vLLM layout, for comparisons); the
            default gives states pages of their own.

    Raises:
        LayoutError: bad specs or stages, layers that cannot share a page size, or a
            budget below one block per group plus the null block.
    """
    _check_inputs(specs, budget_bytes, block_size)
    readers = {s.name for s in specs if not owns_pages(s)}
    specs = [s for s in specs if s.name not in readers]
    if stages is not None:
        stages = [[n for n in stage if n not in readers] for stage in stages]
    names = [s.name for s in specs]
    stage_names = _check_stages(names, stages)
    if not specs:
        return LayoutPlan(
            block_size=block_size, num_blocks=0, block_bytes=0, groups=(), group_size=0,
            layer_slots={}, budget_bytes=budget_bytes, padding_bytes=0,
            uniform_num_blocks=0, stages=stage_names,
        )  # fmt: skip
    if unify_page_size:
        block_size = _unified_block_size(specs, block_size, max_block_size)
    block_bytes, span = _page_sizes(specs, block_size, unify_page_size)
    if span > 1:
        span = _choose_span(specs, block_bytes, block_size, span, budget_bytes)
    packing = Packing(specs, block_bytes, block_size, span)
    groups = packing.groups()
    stage_of = {n: i for i, stage in enumerate(stage_names) for n in stage}
    layer_slots, offsets, stage_slots = packing.assign(groups, stage_of, len(stage_names))
    group_size = max(stage_slots)
    num_blocks = budget_bytes // (group_size * block_bytes) // span * span
    least = _least_blocks(groups, span)
    if num_blocks < least:
        need = least * group_size * block_bytes
        raise LayoutError(
            f"budget_bytes={budget_bytes} holds {num_blocks} blocks of {group_size} slots x "
            f"{block_bytes} bytes; {len(groups)} groups need at least {least} "
            f"blocks (the null block included), so at least {need} bytes"
        )
    by_name = {s.name: s for s in specs}
    slot_bytes = sum(stage_slots) * block_bytes  # one page id, over every stage's tensors
    worst = max(slot_bytes - group_bytes(g, by_name, block_size) // page_ids(g, span)
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
        state_span=span,
        layer_offsets=offsets,
    )


#: The K/V page may be up to this many times the widest layer's page (``_kv_page``).
MAX_PAGE_MULTIPLE = 8


def _page_sizes(specs: Sequence[LayerSpec], block_size: int, unified: bool) -> tuple[int, int]:
    """Bytes of a K/V page per slot, and the K/V pages one state page takes."""
    kv = [s for s in specs if not isinstance(s, StateSpec)]
    states = [s.state_bytes for s in specs if isinstance(s, StateSpec)]
    if unified or not kv:
        return max([s.block_bytes(block_size) for s in kv] + states), 1
    page = _kv_page(kv, block_size)
    return (page, 1) if not states else (page, cdiv(max(states), page))


def _kv_page(specs: Sequence[LayerSpec], block_size: int) -> int:
    """The K/V page: the multiple of the widest layer's page (up to
    ``MAX_PAGE_MULTIPLE``) whose slots hold the K/V layers in the fewest bytes, the
    layers of each policy and page size k to a slot where their page is a k-th of it
    (else one, padded); the smaller on a tie. DeepSeek V3.2's 61 latents of 18 KiB a page
    and 61 index keys of 4 KiB: 36 KiB, two latents or nine index keys a slot (38 slots,
    where 18 KiB pages take 122)."""
    sizes = [s.block_bytes(block_size) for s in specs]
    counts: dict[tuple[object, int], int] = {}
    for spec, size in zip(specs, sizes, strict=True):
        counts[(spec.policy, size)] = counts.get((spec.policy, size), 0) + 1

    def held(page: int) -> int:
        per_slot = {size: 1 if page % size else page // size for _, size in counts}
        return page * sum(cdiv(n, per_slot[size]) for (_, size), n in counts.items())

    widest = max(sizes)
    return min((m * widest for m in range(1, MAX_PAGE_MULTIPLE + 1)), key=held)


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
    owners = {s.name for s in specs if owns_pages(s)}
    for spec in specs:
        if page_owner(spec) not in owners:
            raise LayoutError(
                f"layer {spec.name!r} reads the pages of {page_owner(spec)!r}, which is not "
                "a layer that keeps pages of its own"
            )


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


def _least_blocks(groups: Sequence[KVGroup], span: int) -> int:
    """Page ids a pool needs: the null page's span, a state page per state group and a
    K/V page per K/V group (in whole spans where states span several)."""
    if span == 1:
        return 1 + len(groups)
    num_state = sum(1 for g in groups if g.policy.keeps_state)
    return span * (1 + num_state + cdiv(len(groups) - num_state, span))


def _choose_span(
    specs: Sequence[LayerSpec], page: int, block_size: int, least: int, budget: int
) -> int:
    """The state span: the least one, or a longer one that packs several states to a slot
    where that takes the states' padding under :data:`PADDING_GOAL`.

    States lie one after another over a group's state page in every slot, so a state may
    run on from one slot into the next: what pads is the end of the group's page. Zamba2
    7B's 81 states of 4.2 K/V pages over 13 slots pad 25% at 5 pages, 3.2% at 9. A longer
    span is taken only if it adds no group, pads the K/V families no more, and the budget
    still holds the pool's least pages; of those, the least span under the goal, else the
    one of least padding. The least: a state page needs a span with no K/V page in use,
    and long spans are the harder to find whole (Zamba2's chats in hybrid_cliffs hit 0.603
    of their prefixes at 9 pages, 0.550 at 27).
    """

    def cost(span: int) -> tuple[int, int, float] | None:
        """Groups, K/V padding per page id and state padding share at ``span``; None
        where the budget cannot hold the pool's least pages."""
        packing = Packing(specs, page, block_size, span)
        groups = packing.groups()
        size = max(packing.slots(g.layer_names) for g in groups)
        if budget // (size * page) // span * span < _least_blocks(groups, span):
            return None
        by_name = packing.by_name
        kv = [g for g in groups if not g.policy.keeps_state]
        kv_padding = sum(size * page - group_bytes(g, by_name, block_size) for g in kv)
        states = [g for g in groups if g.policy.keeps_state]
        held = len(states) * size * span * page
        used = sum(group_bytes(g, by_name, block_size) for g in states)
        return len(groups), kv_padding, (held - used) / held

    base = cost(least)
    if base is None or base[2] < PADDING_GOAL:
        return least

    def rank(span: int, share: float) -> tuple[int, float, int]:
        # Under the goal: the least span; else the least padding, then the least span.
        return (0, 0.0, span) if share < PADDING_GOAL else (1, share, span)

    best = rank(least, base[2])
    for span in range(least + 1, least * _LONGEST_SPAN + 1):
        found = cost(span)
        if found is not None and found[0] <= base[0] and found[1] <= base[1]:
            best = min(best, rank(span, found[2]))
    return best[2]
