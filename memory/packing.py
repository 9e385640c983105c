"""How a plan's layers fill its pages: K/V layers in slots (k to a slot where their pages
are a k-th of the page, each page size in slots of its own), states one after another
over a state page of every slot, the families cut into groups of one slot count, and each
layer's slot and byte offset per pipeline stage. ``hybridkv.memory.layout_planner``
chooses the page sizes and the span; this lays the layers out in them."""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.memory.layout import KVGroup, LayerSpec, StateSpec
from hybridkv.policies.base import MemoryPolicy, cdiv

__all__ = ["Packing", "choose_group_size"]


def choose_group_size(counts: Sequence[int]) -> int:
    """Layers per group: the family count leaving fewest empty slots, larger on a tie."""
    if not counts:
        return 0

    def empty_slots(size: int) -> int:
        return sum(cdiv(m, size) * size - m for m in counts)

    return min(set(counts), key=lambda size: (empty_slots(size), -size))


def _kv_per_slot(spec: LayerSpec, page: int, block_size: int) -> int:
    """K/V layers like ``spec`` that fit side by side in one slot of ``page`` bytes: k where
    its page is exactly a k-th of it, else 1 (a page padded to ``page``)."""
    own = spec.block_bytes(block_size)
    return 1 if page % own else page // own


def _stride(spec: StateSpec) -> int:
    """Bytes a state takes in its group's state page: whole float32 values."""
    return cdiv(spec.state_bytes, 4) * 4


class Packing:
    """How the layers of ``specs`` fill pages of ``page`` bytes at ``block_size``, states
    in state pages of ``span`` pages: K/V layers k to a slot where they pack (the layers of
    one page size together), states one after another over the state page of every slot
    (``state_page`` bytes a slot)."""

    def __init__(self, specs: Sequence[LayerSpec], page: int, block_size: int, span: int):
        self.by_name = {s.name: s for s in specs}
        self.page, self.block_size, self.span = page, block_size, span
        self.state_page = span * page

    def slots(self, names: Sequence[str]) -> int:
        """Slots the layers ``names`` of one policy take: K/V layers of each page size k
        to a slot, states one after another over the state pages."""
        specs = [self.by_name[n] for n in names]
        if isinstance(specs[0], StateSpec):
            return cdiv(sum(_stride(s) for s in specs if isinstance(s, StateSpec)), self.state_page)
        widths: dict[int, int] = {}
        for spec in specs:
            own = spec.block_bytes(self.block_size)
            widths[own] = widths.get(own, 0) + 1
        return sum(
            cdiv(count, _kv_per_slot(spec, self.page, self.block_size))
            for spec, count in ((self._of_width(specs, own), n) for own, n in widths.items())
        )

    def _of_width(self, specs: Sequence[LayerSpec], own: int) -> LayerSpec:
        return next(s for s in specs if s.block_bytes(self.block_size) == own)

    def groups(self) -> tuple[KVGroup, ...]:
        """Families of equal policies cut into groups of ``choose_group_size`` slots."""
        families: dict[MemoryPolicy, list[str]] = {}
        for spec in self.by_name.values():
            families.setdefault(spec.policy, []).append(spec.name)
        size = choose_group_size([self.slots(names) for names in families.values()])
        groups: list[KVGroup] = []
        for policy, layers in families.items():
            if policy.keeps_state:  # as many as the group's state page holds
                states = [self.by_name[n] for n in layers]
                widest = max(_stride(s) for s in states if isinstance(s, StateSpec))
                num_groups = cdiv(len(layers), max(1, size * self.state_page // widest))
            else:
                num_groups = cdiv(self.slots(layers), size)
            for i in range(num_groups):
                names = tuple(layers[i::num_groups])
                groups.append(KVGroup(group_id=len(groups), policy=policy, layer_names=names))
        return tuple(groups)

    def assign(
        self, groups: Sequence[KVGroup], stage_of: dict[str, int], num_stages: int
    ) -> tuple[dict[str, tuple[int, int]], dict[str, int], list[int]]:
        """Layer -> (group, slot within its stage) and byte offset: a K/V layer's in its
        slot's page, a state's in its group's state page (the slots side by side, so a
        state may run on into the next slot: its slot is the last it reaches); and the
        slots of each stage."""
        layer_slots: dict[str, tuple[int, int]] = {}
        offsets: dict[str, int] = {}
        stage_slots = [0] * num_stages
        for group in groups:
            used = [0] * num_stages  # slots, or a state page's bytes
            # Per stage and K/V page size: the slot being filled and the layers in it.
            filling: dict[tuple[int, int], tuple[int, int]] = {}
            for name in group.layer_names:
                stage, spec = stage_of[name], self.by_name[name]
                if isinstance(spec, StateSpec):
                    start, used[stage] = used[stage], used[stage] + _stride(spec)
                    slot = cdiv(used[stage], self.state_page) - 1
                else:
                    own = spec.block_bytes(self.block_size)
                    slot, count = filling.get((stage, own), (used[stage], 0))
                    if count == _kv_per_slot(spec, self.page, self.block_size):
                        slot, count = used[stage], 0
                    if slot == used[stage]:  # a fresh slot
                        used[stage] += 1
                    start = count * own
                    filling[(stage, own)] = (slot, count + 1)
                layer_slots[name] = (group.group_id, slot)
                if start:
                    offsets[name] = start
            if group.policy.keeps_state:
                used = [cdiv(n, self.state_page) for n in used]
            stage_slots = [max(a, b) for a, b in zip(stage_slots, used, strict=True)]
        return layer_slots, offsets, stage_slots
