"""The executor's KV tensors: laid out by the plan, checked against what each layer attends.

Memory picture (plan.group_size = 2 slots, N page ids): one tensor, each page id's page
of every slot side by side::

    page 0 (null)  [ slot 0 | slot 1 ]
    page 1         [ slot 0 | slot 1 ]     K/V: the layers of slot 0 and 1 of its group
    ...
    page N-1       [ slot 0 | slot 1 ]

An attention layer views its slot's column as ``[N, 2, kv_heads, block_size, head_dim]``,
from its offset in the slot's page (layers whose pages are a fraction of the slot's sit
side by side: ``plan.layer_offsets``). A page id belongs to one group at a time, so the
layers sharing a slot never collide. A state layer views the pool as float32 rows, one
per state page, whatever the model's dtype (``hybridkv.models.blocks.state_mixer`` has
the row's layout): where a state page spans ``plan.state_span`` page ids, row ``r`` is the
bytes of pages ``r * span .. r * span + span - 1`` over every slot, ``[N // span,
state_values]`` from the state's offset in them (a group's states one after another, a
state running on from one slot into the next), and page id ``p`` of a state group reads
row ``p // span`` (``StepStates`` translates).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import attrs
import torch

from hybridkv.memory.layout import (
    AttentionSpec,
    LayoutPlan,
    ModelLayer,
    NoCacheSpec,
    StateSpec,
    memories,
    owns_pages,
)
from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import ModelConfigError
from hybridkv.policies.base import MemoryPolicy

_Spec = TypeVar("_Spec", bound=AttentionSpec | StateSpec)


def allocate_kv_caches(
    plan: LayoutPlan, specs: Sequence[ModelLayer], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One zeroed pool of the slots the ``specs`` use, and per memory of their layers
    (``memories``: a layer's, then the state beside it) its paged view of it. A pipeline
    stage passes only its layers, and allocates only their slots.
    A layer that reads another's pages (``AttentionSpec.reads``) gets its owner's view, one
    that keeps nothing (``NoCacheSpec``) an empty tensor; a latent layer's view has a K/V
    axis of stride 0 (``kernels/geometry.py``)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    page_elems = plan.block_bytes // itemsize
    specs = memories(specs)
    cached = [s for s in specs if not isinstance(s, NoCacheSpec)]
    num_slots = max((plan.slot_of(s)[1] + 1 for s in cached), default=0)
    # Zeros, not empty: a masked read of garbage NaN would still poison the output.
    pool = torch.zeros(plan.num_blocks, num_slots, page_elems, dtype=dtype, device=device)
    rows = (
        _state_rows(pool, plan.state_span)
        if any(isinstance(s, StateSpec) for s in cached)
        else None
    )
    views = []
    for spec in specs:
        if isinstance(spec, NoCacheSpec):
            views.append(torch.empty(0, dtype=dtype, device=device))
            continue
        if isinstance(spec, StateSpec):
            assert rows is not None
            start = plan.offset_of(spec) // 4
            views.append(rows[:, start : start + spec.state_bytes // 4])
            continue
        _, slot = plan.slot_of(spec)
        # A latent (multi-head latent attention) is one vector a token, read as the key
        # and the value: a K/V axis of stride 0 over pages of keys alone.
        runs = 1 if spec.latent else 2
        positions = spec.policy.page_positions(plan.block_size)  # compressed: fewer
        shape = (plan.num_blocks, runs, spec.num_kv_heads, positions, spec.head_dim)
        start = plan.offset_of(spec) // itemsize
        layer_elems = spec.block_bytes(plan.block_size) // itemsize
        view = pool[:, slot, start : start + layer_elems].view(shape)
        views.append(view.expand(-1, 2, -1, -1, -1))
    return views


def _state_rows(pool: torch.Tensor, span: int) -> torch.Tensor:
    """The pool as float32 rows, one per state page: its span of page ids over every slot."""
    num_blocks, num_slots, page_elems = pool.shape
    return pool.view(num_blocks // span, span * num_slots * page_elems).view(torch.float32)


def layer_groups(plan: LayoutPlan, specs: Sequence[ModelLayer]) -> list[int | None]:
    """Per memory of ``specs``' layers (``memories``), the KV group whose pages it reads;
    None for a layer keeping nothing."""
    return [None if isinstance(s, NoCacheSpec) else plan.slot_of(s)[0] for s in memories(specs)]


def sparse_groups(plan: LayoutPlan, groups: Sequence[int]) -> list[bool]:
    """Per KV group of ``groups``, whether its entries span blocks, its tables holding
    pages only in the blocks entries end in (DeepSeek V4's compressed entries): the
    ``sparse`` of ``PagedMetadata.build_groups``."""
    bs = plan.block_size
    return [plan.groups[g].policy.page_blocks(0, bs + 1, bs) is not None for g in groups]


def kept_specs(config: ModelConfig, plan: LayoutPlan, dtype: torch.dtype) -> list[ModelLayer]:
    """Per layer (the decoder's, then an MTP layer's: ``planned_layers``), its spec with the
    policy of its KV group in ``plan``: what its pages keep.

    A group may keep more than its layers attend (``uniform_layout`` keeps every position),
    never less: a layer would read pages the allocator has released.

    Raises:
        ModelConfigError: the plan and the model disagree on layers, the cached dtype, or
            what a layer's group keeps.
    """
    names = [s.name for s in memories(config.planned_layers) if owns_pages(s)]
    if sorted(names) != sorted(plan.layer_slots):
        raise ModelConfigError(
            f"the layout's layers {sorted(plan.layer_slots)[:4]}... are not the model's "
            f"{config.num_layers} attention layers {names[:4]}..."
        )
    itemsize = torch.empty((), dtype=dtype).element_size()
    kept: list[ModelLayer] = []
    for spec in config.planned_layers:
        if isinstance(spec, NoCacheSpec):
            kept.append(spec)
            continue
        if isinstance(spec, AttentionSpec) and spec.dtype_bytes != itemsize:
            raise ModelConfigError(
                f"layer spec {spec.name!r} caches {spec.dtype_bytes} bytes per value, the "
                f"model's dtype {dtype} has {itemsize}"
            )
        kept.append(_kept_chain(config, plan, spec))
    return kept


def _kept_chain(config: ModelConfig, plan: LayoutPlan, spec: _Spec) -> _Spec:
    """``spec`` and every memory beside it with the policies of their KV groups."""
    if isinstance(spec, AttentionSpec) and spec.beside is not None:
        return attrs.evolve(
            _kept(config, plan, spec), beside=_kept_chain(config, plan, spec.beside)
        )
    return _kept(config, plan, spec)


def _kept(config: ModelConfig, plan: LayoutPlan, spec: _Spec) -> _Spec:
    """``spec`` with the policy of its KV group in ``plan``."""
    policy = plan.groups[plan.slot_of(spec)[0]].policy
    if policy != spec.policy:
        n = _first_unkept(policy, spec.policy, config.max_position_embeddings)
        if n is not None:
            raise ModelConfigError(
                f"layer {spec.name!r} attends by {spec.policy!r}, but its KV group keeps "
                f"{policy!r}, which has released positions the layer reads at {n} tokens"
            )
    return attrs.evolve(spec, policy=policy)


def _first_unkept(kept: MemoryPolicy, attended: MemoryPolicy, max_len: int) -> int | None:
    """A token count at which ``attended`` reads a position ``kept`` has released, or None.

    A sampled check, not a proof: every count up to 256 and the powers of two up to
    ``max_len``, where windows and sinks of a mismatched layout show; it runs once per load.
    """
    counts = {*range(min(max_len, 256) + 1), *(1 << k for k in range(max_len.bit_length()))}
    for n in sorted(counts | {max_len}):
        held = _merged(kept.live_spans(n))
        for start, end in attended.live_spans(n):
            if not any(a <= start and end <= b for a, b in held):
                return n
    return None


def _merged(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted spans with touching neighbours joined, so containment is one comparison."""
    out: list[tuple[int, int]] = []
    for start, end in spans:
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
