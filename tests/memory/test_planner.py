"""The layout planner: groups, page sizes, pool size, stages, and the uniform baseline."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from hybridkv.memory.errors import LayoutError
from hybridkv.memory.layout import AttentionSpec, LayerSpec, StateSpec
from hybridkv.memory.layout_planner import choose_group_size, describe, plan_layout
from hybridkv.policies import FullAttention, MambaLike, SlidingWindow

FULL = FullAttention()
SW = SlidingWindow(window=32)
PAGE = 2 * 1 * 256 * 2 * 16  # K and V, one head of 256, bfloat16, 16 tokens: 16 KiB


def attn(name: str, policy: Any = FULL, head_dim: int = 256) -> AttentionSpec:
    return AttentionSpec(name=name, policy=policy, num_kv_heads=1, head_dim=head_dim, dtype_bytes=2)


def seed_model() -> list[LayerSpec]:
    """Seed 000's example: two full and four sliding layers."""
    return [
        attn("full.0"), attn("sw.0", SW), attn("sw.1", SW),
        attn("full.1"), attn("sw.2", SW), attn("sw.3", SW),
    ]  # fmt: skip


def gemma3_like() -> list[LayerSpec]:
    """26 layers, every sixth full: 4 full and 22 sliding."""
    return [attn(f"l{i}", FULL if (i + 1) % 6 == 0 else SW) for i in range(26)]


SEED_STAGES = [["full.0", "sw.0", "sw.1"], ["full.1", "sw.2", "sw.3"]]


def test_seed_pipeline_example_groups_by_stride() -> None:
    """Seed 000's stages give groups (full.0, full.1), (sw.0, sw.2), (sw.1, sw.3)."""
    plan = plan_layout(seed_model(), 1 << 20, stages=SEED_STAGES)
    assert [g.layer_names for g in plan.groups] == [
        ("full.0", "full.1"),
        ("sw.0", "sw.2"),
        ("sw.1", "sw.3"),
    ]
    assert plan.policies == (FULL, SW, SW)


def test_seed_pipeline_example_each_stage_holds_one_layer_per_group() -> None:
    """Every stage uses one slot, holding one layer of each group."""
    plan = plan_layout(seed_model(), 1 << 20, stages=SEED_STAGES)
    assert plan.group_size == 1
    assert plan.layer_slots == {
        "full.0": (0, 0), "sw.0": (1, 0), "sw.1": (2, 0),
        "full.1": (0, 0), "sw.2": (1, 0), "sw.3": (2, 0),
    }  # fmt: skip
    assert plan.num_blocks == (1 << 20) // PAGE
    assert plan.stages == (("full.0", "sw.0", "sw.1"), ("full.1", "sw.2", "sw.3"))


def test_without_stages_slots_are_positions_in_the_group() -> None:
    """One device holds every slot: layer j of a group is in slot j."""
    plan = plan_layout(seed_model(), 1 << 20)
    assert plan.group_size == 2
    assert plan.layer_slots["sw.2"] == (1, 1)
    assert plan.num_blocks == (1 << 20) // (2 * PAGE)
    assert plan.pool_bytes <= plan.budget_bytes
    assert plan.stages == (tuple(s.name for s in seed_model()),)


def test_gemma3_like_groups_four_layers_with_strided_sliding_groups() -> None:
    """4 full + 22 sliding: groups of 4, six sliding groups holding layers[i::6]."""
    specs = gemma3_like()
    plan = plan_layout(specs, 1 << 30)
    sliding = [s.name for s in specs if s.policy == SW]
    assert plan.group_size == 4
    assert plan.block_bytes == PAGE
    assert [g.layer_names for g in plan.groups[:6]] == [tuple(sliding[i::6]) for i in range(6)]
    assert [len(g.layer_names) for g in plan.groups] == [4, 4, 4, 4, 3, 3, 4]
    assert plan.groups[6].layer_names == ("l5", "l11", "l17", "l23")


def test_gemma3_like_two_stages_share_slots_within_each_stage() -> None:
    """Two stages of 13 layers each need two slots, not three."""
    specs = gemma3_like()
    names = [s.name for s in specs]
    plan = plan_layout(specs, 1 << 30, stages=[names[:13], names[13:]])
    assert plan.group_size == 2
    assert plan.num_blocks == (1 << 30) // (2 * PAGE)


@pytest.mark.parametrize(
    ("counts", "size"), [((4, 22), 4), ((10, 11), 11), ((2, 4), 2), ((32,), 32), ((), 0)]
)
def test_group_size_leaves_fewest_empty_slots(counts: tuple[int, ...], size: int) -> None:
    """The group size is the family count with fewest empty slots, larger on a tie."""
    assert choose_group_size(counts) == size


def test_padding_counts_empty_slots() -> None:
    """2 full + 3 sliding: groups of 3, the full group's empty slot is padding."""
    specs = [attn("f0"), attn("f1"), attn("s0", SW), attn("s1", SW), attn("s2", SW)]
    plan = plan_layout(specs, 100 * 3 * PAGE)
    assert plan.group_size == 3
    assert [len(g.layer_names) for g in plan.groups] == [2, 3]
    assert plan.num_blocks == 100
    assert plan.padding_bytes == 100 * PAGE


def test_padding_fraction_weighs_groups_by_pages_held() -> None:
    """The report's padding share counts each group's pages at the request length."""
    specs = [attn("f0"), attn("f1"), attn("s0", SW), attn("s1", SW), attn("s2", SW)]
    report = describe(plan_layout(specs, 100 * 3 * PAGE), specs, 160)
    # The full group holds 10 pages with one empty slot of 3, the window group 3 full pages.
    assert [g.blocks_per_request for g in report.groups] == [10, 3]
    assert [g.padding_bytes_per_block for g in report.groups] == [PAGE, 0]
    assert report.padding_fraction == pytest.approx(10 / (13 * 3))


def test_smaller_attention_pages_are_padded_to_the_largest() -> None:
    """A head dim of 128 beside 256 gets the larger page, half of it padding."""
    specs = [attn("f0"), attn("s0", SW, head_dim=128)]
    plan = plan_layout(specs, 1 << 20)
    report = describe(plan, specs, 16)
    assert plan.block_bytes == PAGE
    assert [g.padding_bytes_per_block for g in report.groups] == [0, PAGE // 2]
    assert plan.padding_bytes == plan.num_blocks * PAGE // 2


def test_state_larger_than_attention_page_takes_a_span_of_pages() -> None:
    """A 40 KiB state takes 3 K/V pages of 16 KiB (16 tokens); the block stays 16."""
    specs: list[LayerSpec] = [
        attn("a0"),
        StateSpec(name="m0", policy=MambaLike(), state_bytes=40 * 1024),
    ]
    plan = plan_layout(specs, 1 << 20, block_size=16)
    report = describe(plan, specs, 96)
    assert (plan.block_size, plan.block_bytes, plan.state_span) == (16, PAGE, 3)
    assert plan.state_page_bytes == 48 * 1024 and plan.num_blocks % 3 == 0
    assert plan.pool.state_span == 3
    assert [g.page_ids for g in report.groups] == [1, 3]
    assert [g.padding_bytes_per_block for g in report.groups] == [0, 8 * 1024]
    # A request of 96 tokens: 6 K/V pages and the state group's peak of 3 state pages.
    assert report.blocks_per_request == 6 + 3 * 3


def test_states_pack_into_a_longer_span_when_one_each_pads_past_the_goal() -> None:
    """Four 40 KiB states beside two K/V layers of 16 KiB: one state to 3 pages pads
    16.7% (two groups of two slots); a state page of 5 pages (80 KiB) in each of the two
    slots holds all four, one after another, nothing padded, in one group."""
    states = [StateSpec(name=f"m{i}", policy=MambaLike(), state_bytes=40 * 1024) for i in range(4)]
    specs: list[LayerSpec] = [attn("a0"), attn("a1"), *states]
    plan = plan_layout(specs, 1 << 22, block_size=16)
    report = describe(plan, specs, 96)
    assert (plan.block_size, plan.state_span, plan.group_size) == (16, 5, 2)
    assert [(g.policy, len(g.layer_names)) for g in plan.groups] == [(FULL, 2), (MambaLike(), 4)]
    # Offsets within the group's state page (5 pages of slot 0, then 5 of slot 1); a
    # state's slot is the last it reaches.
    assert [plan.offset_of(s) for s in states] == [0, 40 * 1024, 80 * 1024, 120 * 1024]
    assert [plan.layer_slots[s.name] for s in states] == [(1, 0), (1, 0), (1, 1), (1, 1)]
    assert [g.padding_bytes_per_block for g in report.groups] == [0, 0]


def test_states_run_on_across_slots_and_are_not_packed_where_that_pads_more() -> None:
    """A lone 40 KiB state keeps its 3-page span (16.7%): a longer one would pad more.
    Six beside four K/V layers fill five slots of 3 pages exactly, a state running on from
    one slot into the next where the slot's page ends inside it."""
    state = StateSpec(name="m0", policy=MambaLike(), state_bytes=40 * 1024)
    assert plan_layout([attn("a0"), state], 1 << 22).state_span == 3
    six: list[LayerSpec] = [attn(f"a{i}") for i in range(4)]
    six += [attrs.evolve(state, name=f"m{i}") for i in range(6)]
    plan = plan_layout(six, 1 << 22)
    report = describe(plan, six, 96)
    assert (plan.state_span, plan.group_size, len(plan.groups)) == (3, 5, 2)
    assert [plan.layer_slots[f"m{i}"][1] for i in range(6)] == [0, 1, 2, 3, 4, 4]
    assert [g.padding_bytes_per_block for g in report.groups] == [PAGE, 0]


def test_one_page_size_raises_block_size() -> None:
    """``unify_page_size``: a 40 KiB state makes blocks of 48 tokens (48 KiB pages); the
    state pads 8 KiB (what a single page size forces, as vLLM)."""
    specs: list[LayerSpec] = [
        attn("a0"),
        StateSpec(name="m0", policy=MambaLike(), state_bytes=40 * 1024),
    ]
    plan = plan_layout(specs, 1 << 20, block_size=16, unify_page_size=True)
    report = describe(plan, specs, 96)
    assert plan.block_size == 48
    assert plan.block_bytes == 3 * PAGE
    assert [g.padding_bytes_per_block for g in report.groups] == [0, 8 * 1024]
    assert plan.padding_bytes == plan.num_blocks * 8 * 1024


def test_state_smaller_than_attention_page_is_padded() -> None:
    """A state smaller than the attention page keeps the block size and pads the state."""
    specs: list[LayerSpec] = [
        attn("a0"),
        StateSpec(name="m0", policy=MambaLike(), state_bytes=1000),
    ]
    plan = plan_layout(specs, 1 << 20)
    assert (plan.block_size, plan.block_bytes) == (16, PAGE)
    assert plan.padding_bytes == plan.num_blocks * (PAGE - 1000)


def test_state_too_large_for_any_block_is_an_error() -> None:
    """With one page size, a state needing blocks past max_block_size cannot share it."""
    specs: list[LayerSpec] = [
        attn("a0"),
        StateSpec(name="m0", policy=MambaLike(), state_bytes=PAGE * 9),
    ]
    with pytest.raises(
        LayoutError, match=r"cannot share a page size.*'m0'.*144.*max_block_size=128"
    ):
        plan_layout(specs, 1 << 30, max_block_size=128, unify_page_size=True)


def test_attention_free_model_has_no_groups() -> None:
    """No KV layers: no groups, no blocks, and nothing limits requests."""
    plan = plan_layout([], 0)
    report = describe(plan, [], 100)
    assert (plan.groups, plan.num_blocks, plan.group_size) == ((), 0, 0)
    assert report.max_requests is None and report.max_request_tokens is None
    assert report.gain is None


def test_stage_without_kv_layers_is_fine() -> None:
    """An empty stage allocates nothing and leaves the pool as one stage would."""
    names = [s.name for s in seed_model()]
    plan = plan_layout(seed_model(), 1 << 20, stages=[names, []])
    report = describe(plan, seed_model(), 16)
    assert plan.group_size == 2
    assert plan.num_blocks == plan_layout(seed_model(), 1 << 20).num_blocks
    assert report.stage_slots == (2, 0)


def test_budget_below_one_block_per_group_is_an_error() -> None:
    """Three groups need four blocks (null included); one byte less is refused."""
    minimum = 4 * 2 * PAGE
    assert plan_layout(seed_model(), minimum).num_blocks == 4
    with pytest.raises(LayoutError, match=rf"budget_bytes={minimum - 1}.*at least {minimum} bytes"):
        plan_layout(seed_model(), minimum - 1)


def test_policy_that_is_not_a_policy_is_an_error() -> None:
    """A spec naming its policy by string is refused with a pointer to make_policy."""
    with pytest.raises(LayoutError, match=r"'x'.*'full'.*make_policy"):
        plan_layout([attn("x", "full")], 1 << 20)


def test_duplicate_layer_names_are_an_error() -> None:
    """Two specs with one name are refused, naming it."""
    with pytest.raises(LayoutError, match="'a'"):
        plan_layout([attn("a"), attn("a")], 1 << 20)


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([["full.0", "nope"]], "no spec: \\['nope'\\]"),
        ([["full.0", "full.0"]], "more than once: \\['full.0'\\]"),
        ([["full.0"]], "in no stage"),
        ([], "at least one stage"),
    ],
)
def test_bad_stages_are_errors(stages: list[list[str]], message: str) -> None:
    """Stages must list every KV layer exactly once, and nothing else."""
    with pytest.raises(LayoutError, match=message):
        plan_layout(seed_model(), 1 << 20, stages=stages)


def test_uniform_comparison_numbers_are_exact() -> None:
    """Seed model in 4 MiB at 256 tokens: 5 requests against uniform's 2."""
    specs = seed_model()
    plan = plan_layout(specs, 4 << 20)
    report = describe(plan, specs, 256)
    assert plan.num_blocks == (4 << 20) // (2 * PAGE) == 128
    assert plan.uniform_num_blocks == (4 << 20) // (6 * PAGE) == 42
    # Full needs 256/16 = 16 pages; a window of 32 at most cdiv(31, 16) + 1 = 3 per group.
    assert (report.blocks_per_request, report.uniform_blocks_per_request) == (22, 16)
    assert (report.max_requests, report.uniform_max_requests) == (127 // 22, 41 // 16)
    assert report.gain == pytest.approx(5 / 2)
    # Longest request: 16 * (127 - 2 * 3) tokens against 16 * 41.
    assert (report.max_request_tokens, report.uniform_max_request_tokens) == (1936, 656)


def test_windows_only_model_has_unbounded_longest_request() -> None:
    """Without full attention no request length outgrows the pool."""
    specs = [attn("s0", SW), attn("s1", SW)]
    report = describe(plan_layout(specs, 1 << 20), specs, 64)
    assert report.max_request_tokens is None
    assert report.uniform_max_request_tokens == 16 * ((1 << 20) // (2 * PAGE) - 1)


def test_report_groups_policies_into_families() -> None:
    """The per-policy rows sum their groups' layers and pages."""
    specs = gemma3_like()
    report = describe(plan_layout(specs, 1 << 30), specs, 4096)
    rows = {p.policy: (p.num_groups, p.num_layers, p.blocks_per_request) for p in report.policies}
    assert rows == {"sliding_window(window=32)": (6, 22, 6 * 3), "full": (1, 4, 256)}


def test_layers_reading_another_layers_pages_own_none() -> None:
    """Seed 000's model plus two layers reading full.1's and sw.3's pages (Gemma 4's
    shared-KV layers): the plan is the seed model's, with the readers in no slot and
    each resolved to its owner's (group, slot), in one stage or two."""
    readers = [
        attrs.evolve(attn("read.full"), reads="full.1"),
        attrs.evolve(attn("read.sw", SW), reads="sw.3"),
    ]
    alone = plan_layout(seed_model(), 1 << 22)
    plan = plan_layout(seed_model() + readers, 1 << 22)
    assert (plan.num_blocks, plan.groups, plan.layer_slots) == (
        alone.num_blocks, alone.groups, alone.layer_slots,
    )  # fmt: skip
    assert plan.uniform_num_blocks == alone.uniform_num_blocks
    assert [plan.slot_of(r) for r in readers] == [
        plan.layer_slots["full.1"],
        plan.layer_slots["sw.3"],
    ]
    staged = plan_layout(
        seed_model() + readers,
        1 << 22,
        stages=[*SEED_STAGES[:1], [*SEED_STAGES[1], "read.full", "read.sw"]],
    )
    assert staged.stages == plan_layout(seed_model(), 1 << 22, stages=SEED_STAGES).stages


def test_a_layer_reading_pages_no_layer_keeps_is_refused() -> None:
    """Reading a layer that is not there, or one that itself reads another's: refused."""
    for owner in ("nowhere", "read.a"):
        specs = [*seed_model(), attrs.evolve(attn("read.a"), reads="full.0")]
        specs.append(attrs.evolve(attn("read.b"), reads=owner))
        with pytest.raises(LayoutError, match=f"'read.b' reads the pages of '{owner}'"):
            plan_layout(specs, 1 << 22)


def test_half_pages_pack_two_layers_to_a_slot() -> None:
    """Gemma 4 31B's shape in small: 5 sliding layers of two heads and a full layer of one,
    twice over. The full layers' pages are half the sliding ones': both share one slot of
    one group, side by side, and no byte is padding; a third size that does not divide
    the page (three heads of four) is padded as before."""
    wide = [AttentionSpec(name=f"sw{i}", policy=SW, num_kv_heads=2, head_dim=256, dtype_bytes=2)
            for i in range(10)]  # fmt: skip
    full = [attn("full.0"), attn("full.1")]
    plan = plan_layout([*wide[:5], full[0], *wide[5:], full[1]], 1 << 24)
    assert plan.block_bytes == 2 * PAGE
    assert plan.layer_slots["full.0"][0] == plan.layer_slots["full.1"][0]
    assert plan.layer_slots["full.0"][1] == plan.layer_slots["full.1"][1]
    assert sorted(plan.layer_offsets.items()) == [("full.1", PAGE)]
    assert plan.padding_bytes == 0
    odd = AttentionSpec(name="odd", policy=FULL, num_kv_heads=3, head_dim=64, dtype_bytes=2)
    padded = plan_layout([*wide[:2], odd], 1 << 24)
    assert padded.layer_offsets == {} and padded.padding_bytes > 0


def test_pages_that_do_not_divide_the_widest_take_the_page_that_holds_them_best() -> None:
    """Twelve layers of 9 units a page and nine of 2 (DeepSeek V3.2's latents and index
    keys, in small): a page of 18 units holds two or nine, 6 + 1 slots and no padding
    where pages of 9 take 21; two layers of 9 and one of 2 keep the page of 9, a bigger
    page leaving slots half empty."""
    wide = [AttentionSpec(name=f"w{i}", policy=FULL, num_kv_heads=1, head_dim=72,
                          dtype_bytes=2) for i in range(12)]  # fmt: skip
    narrow = [AttentionSpec(name=f"n{i}", policy=FULL, num_kv_heads=1, head_dim=16,
                            dtype_bytes=2) for i in range(9)]  # fmt: skip
    unit = 16 * 16 * 2  # 16 values of 2 bytes, 16 tokens
    plan = plan_layout([*wide, *narrow], 1 << 24, block_size=16)
    assert plan.block_bytes == 18 * unit
    assert len({plan.slot_of(s)[1] for s in [*wide, *narrow]}) == 6 + 1
    assert plan.padding_bytes == 0
    few = plan_layout([*wide[:2], narrow[0]], 1 << 24, block_size=16)
    assert few.block_bytes == 9 * unit


def test_packed_layers_stay_in_their_stage() -> None:
    """Two wide sliding layers and four half-page full layers over two stages: each stage
    packs its own two full layers into one slot, so no slot holds layers of two stages."""
    specs = [
        AttentionSpec(name=f"sw{i}", policy=SW, num_kv_heads=2, head_dim=256, dtype_bytes=2)
        for i in range(2)
    ] + [attn(f"f{i}") for i in range(4)]
    plan = plan_layout(specs, 1 << 24, stages=[["sw0", "f0", "f1"], ["sw1", "f2", "f3"]])
    assert {plan.layer_slots[n] for n in ("f0", "f1", "f2", "f3")} == {(1, 0)}
    assert plan.layer_offsets == {"f1": PAGE, "f3": PAGE}
    assert plan.group_size == 1 and plan.padding_bytes == 0


def test_states_smaller_than_half_a_page_share_a_slot() -> None:
    """LFM2's shape in small: four states of a quarter page beside one attention layer
    pack four to a slot, side by side; a state larger than a page still takes a span."""
    states = [StateSpec(name=f"conv{i}", policy=MambaLike(), state_bytes=PAGE // 4)
              for i in range(4)]  # fmt: skip
    plan = plan_layout([*states, attn("full.0")], 1 << 22)
    assert {plan.layer_slots[s.name] for s in states} == {(0, 0)}
    assert [plan.layer_offsets.get(s.name, 0) for s in states] == [
        0,
        PAGE // 4,
        PAGE // 2,
        3 * PAGE // 4,
    ]
    assert plan.group_size == 1 and plan.padding_bytes == 0
    big = StateSpec(name="mamba", policy=MambaLike(), state_bytes=3 * PAGE)
    assert plan_layout([big, attn("full.0")], 1 << 22).layer_offsets == {}
