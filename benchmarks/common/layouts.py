"""The models of hybrid_cliffs.py (published config.json values) and their layouts:
the one place that plans, and the page of each group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from hybridkv.memory.layout import (
    AttentionSpec,
    KVGroup,
    LayerSpec,
    LayoutPlan,
    PoolSpec,
    cached_layers,
)
from hybridkv.memory.layout_planner import plan_layout, policy_label
from hybridkv.models.families import family_for, mtp_specs, normalized
from hybridkv.models.published_shapes import BUILTIN_CONFIGS
from hybridkv.models.specs import layer_specs_from_config
from hybridkv.policies import FullAttention

# -- models: the published config.json values -----------------------------------------

#: The fields ``models/specs.py`` and ``models/shapes/`` read, as published.
MODELS: dict[str, dict[str, Any]] = {
    # ibm-granite/granite-4.0-h-tiny: 40 layers, 4 attention (12 heads, 4 KV heads of
    # 128), 36 Mamba2 (48 heads x 64, d_state 128, 1 group, conv 4); MoE MLPs beside.
    "granite-4.0-h-tiny": {
        "model_type": "granitemoehybrid",
        "num_hidden_layers": 40,
        "hidden_size": 1536,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "layer_types": ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
        "mamba_n_heads": 48,
        "mamba_d_head": 64,
        "mamba_d_state": 128,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    },
    # ibm-ai-platform/Bamba-9B: 32 layers, attention in 9, 18, 27 (32 heads, 8 KV heads
    # of 128), Mamba2 in the rest (128 heads x 64, d_state 128, 1 group, conv 4).
    "bamba-9b": BUILTIN_CONFIGS["bamba-like"],  # the built-in's values are Bamba 9B's
    # nvidia/Nemotron-H-8B-Base-8K: 52 layers, M Mamba2 (128 heads x 64, d_state 128,
    # 8 groups, conv 4), * attention (32 heads, 8 KV heads of 128), - MLP only.
    "nemotron-h-8b": BUILTIN_CONFIGS["nemotron-h-8b-like"],
    # Qwen/Qwen3-Next-80B-A3B and Qwen3.5-27B: Gated DeltaNet (2.1 and 3.1 MiB of state a
    # layer) to full attention, 3:1; LiquidAI/LFM2-1.2B: short convolutions (16 KiB).
    "qwen3-next-80b-a3b": BUILTIN_CONFIGS["qwen3-next-80b-a3b-like"],
    "qwen3.5-27b": BUILTIN_CONFIGS["qwen3.5-27b-like"],
    "lfm2-1.2b": BUILTIN_CONFIGS["lfm2-1.2b-like"],
    # The other mixers at the shapes of hybridkv plan's rows: OLMo Hybrid 7B (DeltaNet),
    # MiniMax-Text-01 (lightning attention, 4 MiB a layer), Jamba (Mamba1), Falcon-H1 7B
    # (Mamba2 beside attention in every layer), Zamba2 7B (shared attention blocks).
    "olmo-hybrid-7b": BUILTIN_CONFIGS["olmo-hybrid-7b-like"],
    "minimax-text-01": BUILTIN_CONFIGS["minimax-text-01-like"],
    "jamba": BUILTIN_CONFIGS["jamba-like"],
    "falcon-h1-7b": BUILTIN_CONFIGS["falcon-h1-7b-like"],
    "zamba2-7b": BUILTIN_CONFIGS["zamba2-7b-like"],
    # Nemotron 3 Nano 30B-A3B: Mamba2 alternating with layers of experts (keeping nothing).
    "nemotron-3-nano": BUILTIN_CONFIGS["nemotron-3-nano-30b-a3b-like"],
    # Kimi-Linear-48B-A3B: Kimi Delta Attention (2.1 MiB of state a layer) beside latent
    # attention (one 576-value latent a token), 20 to 7.
    "kimi-linear-48b-a3b": BUILTIN_CONFIGS["kimi-linear-48b-a3b-like"],
}


def model_specs(name: str, *, mtp: bool = False) -> list[LayerSpec]:
    """The model's memories from hybridkv's parser (bfloat16 K/V, float32 state; a layer
    with a state beside its attention gives both: ``cached_layers``); with ``mtp``, its
    first MTP layer's after them (``hybridkv plan --speculative-config`` method mtp)."""
    layers = layer_specs_from_config(MODELS[name], dtype_bytes=2)
    if mtp:
        layers += mtp_specs(family_for(str(MODELS[name]["model_type"])), MODELS[name], layers)
    return cached_layers(layers)


# -- the layout: the one place that plans ------------------------------------------------


def build_layout(
    model: str, budget: int, block_size: int, *, one_page: bool = False, mtp: bool = False
) -> LayoutPlan:
    """The plan a workload of ``model`` runs at: ``plan_layout`` of its specs (``mtp``:
    with its MTP layer's), with two page sizes (states in spans of K/V pages), or
    ``one_page``: one page size, the block raised until an attention page holds a state
    (hybridkv before two-level pages, and what vLLM does)."""
    specs = model_specs(model, mtp=mtp)
    return plan_layout(specs, budget, block_size, unify_page_size=one_page)


@attrs.frozen
class GroupPage:
    """One group's page: its policy, layers, block size, the bytes of its page in one slot
    tensor and of a page id over every slot, and the bytes its layers fill."""

    policy: str
    num_layers: int
    block_size: int
    slot_bytes: int
    page_id_bytes: int
    content_bytes: int


def _group_page(plan: LayoutPlan, group: KVGroup) -> tuple[int, int]:
    """A group's block size and the bytes of its page in one slot (a state page:
    ``state_span`` K/V pages). The one reader of the plan's page sizes: the rest of the
    script takes each group's values from :func:`group_pages` and :class:`Layout`."""
    span = plan.state_span if group.policy.keeps_state else 1
    return plan.block_size, plan.block_bytes * span


def group_pages(plan: LayoutPlan, specs: Sequence[LayerSpec]) -> list[GroupPage]:
    """Each group's block size and page bytes, from the plan."""
    by_name = {s.name: s for s in specs}
    slots = sum(
        max((plan.layer_slots[n][1] + 1 for n in stage), default=0) for stage in plan.stages
    )
    out = []
    for group in plan.groups:
        block_size, slot_bytes = _group_page(plan, group)
        out.append(
            GroupPage(
                policy=policy_label(group.policy),
                num_layers=len(group.layer_names),
                block_size=block_size,
                slot_bytes=slot_bytes,
                page_id_bytes=slots * slot_bytes,
                content_bytes=sum(by_name[n].block_bytes(block_size) for n in group.layer_names),
            )
        )
    return out


@attrs.frozen
class Layout:
    """A pool to serve workloads from: its groups' block sizes beside the pool spec, and
    the state shapes of its mamba groups (for vLLM's ``MambaSpec``)."""

    pool: PoolSpec
    block_sizes: tuple[int, ...]
    state_shapes: tuple[tuple[int, ...], ...] = ()


def hybrid_layout(model: str, plan: LayoutPlan, specs: Sequence[LayerSpec]) -> Layout:
    cfg = MODELS[model]
    family = family_for(str(cfg["model_type"]))
    assert family is not None and family.state_shape is not None, f"{model} keeps no state"
    pages = group_pages(plan, specs)
    return Layout(
        pool=plan.pool,
        block_sizes=tuple(p.block_size for p in pages),
        state_shapes=family.state_shape(normalized(family, cfg)).parts,
    )


def uniform_layout(plan: LayoutPlan, specs: Sequence[LayerSpec]) -> Layout:
    """The full-attention layout of the same model: every layer an attention layer of the
    model's attention shape (no state anywhere, so no state cliff), all in one group, at
    the plan's block size, in the plan's budget."""
    block_size = max(_group_page(plan, g)[0] for g in plan.groups)
    page = max(s.block_bytes(block_size) for s in specs if isinstance(s, AttentionSpec))
    num_blocks = plan.budget_bytes // (len(specs) * page)
    pool = PoolSpec((FullAttention(),), num_blocks, block_size)
    return Layout(pool=pool, block_sizes=(block_size,))
