"""The planner's byte layout, for any mix of layers and stages: within a page of a group
(its span over every slot of the stage), the group's memories never overlap and stay
inside it, a K/V layer inside its slot's page, a state's slot the last it reaches."""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
from hypothesis import given, settings

from hybridkv.memory.layout import AttentionSpec, LayerSpec, StateSpec
from hybridkv.memory.layout_planner import describe, plan_layout
from hybridkv.policies import FullAttention, MambaLike, SlidingWindow

POLICIES = [FullAttention(), SlidingWindow(window=32)]


@st.composite
def models(draw: st.DrawFn) -> tuple[list[LayerSpec], int]:
    """Attention layers of 1-4 KV heads (pages that pack or pad) and states of 4-160 KiB
    (inside a K/V page or spanning several), in any order, cut into 1-3 stages."""
    specs: list[LayerSpec] = []
    for i in range(draw(st.integers(1, 12))):
        if draw(st.booleans()):
            heads = draw(st.sampled_from([1, 2, 4, 3]))
            policy = draw(st.sampled_from(POLICIES))
            specs.append(
                AttentionSpec(
                    name=f"a{i}", policy=policy, num_kv_heads=heads, head_dim=64, dtype_bytes=2
                )
            )
        else:
            kib = draw(st.integers(1, 40)) * 4
            specs.append(StateSpec(name=f"m{i}", policy=MambaLike(), state_bytes=kib * 1024))
    return specs, draw(st.integers(1, min(3, len(specs))))


@settings(max_examples=150, deadline=None)
@given(models())
def test_memories_of_a_group_never_share_bytes_and_stay_in_its_page(
    model: tuple[list[LayerSpec], int],
) -> None:
    specs, num_stages = model
    per = -(-len(specs) // num_stages)
    stages = [[s.name for s in specs[i : i + per]] for i in range(0, len(specs), per)]
    plan = plan_layout(specs, 1 << 26, block_size=16, stages=stages)
    report = describe(plan, specs, 64)
    page, span = plan.block_bytes, plan.state_span
    for stage, names in enumerate(plan.stages):
        slots = report.stage_slots[stage]
        for group in plan.groups:
            held = [s for s in specs if s.name in names and s.name in group.layer_names]
            state = group.policy.keeps_state
            row = (span if state else 1) * slots * page  # a page of the group, every slot
            ranges = []
            for spec in held:
                offset = plan.offset_of(spec)
                if isinstance(spec, StateSpec):
                    start, size = offset, spec.state_bytes
                    assert plan.layer_slots[spec.name][1] == (start + size - 1) // (span * page)
                else:
                    start, size = (
                        plan.layer_slots[spec.name][1] * page + offset,
                        spec.block_bytes(16),
                    )
                    assert offset + size <= page  # inside its slot's page
                ranges.append((start, start + size))
            ranges.sort()
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(ranges))
            assert not ranges or ranges[-1][1] <= row
