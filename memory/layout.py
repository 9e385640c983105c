"""Layer specs in, layout plan out: the value types of the layout planner.

The planner (``hybridkv.memory.layout_planner``) turns per-layer specs and a byte budget into a
:class:`LayoutPlan`. The executor reads the plan to allocate KV tensors; the KV cache
manager reads it for its groups and pool size.

Memory picture (group_size = 2 slots, three groups sharing one pool of N pages): each
page id holds its page of every slot side by side (``executor/kv_caches.py``)::

              slot 0    slot 1
    page 0  [ null    | null    ]
    page 1  [ full.0  | full.1  ]   a page of group 0: a block of both its layers
    page 2  [ sw.0    | sw.2    ]   a page of group 1
    ...
    page N-1

A page id belongs to one group at a time, and then holds one block of tokens of every
layer of that group, each layer in its own slot (a state group: its states one after
another over the slots). With pipeline stages each stage (device) has its own pool and
numbers the slots of its layers from 0, so a stage holding one layer of each group needs
a single slot.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from hybridkv.policies.base import MemoryPolicy


def _at_least_one(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    from hybridkv.memory.errors import LayoutError

    if value < 1:
        raise LayoutError(f"{attribute.name} must be >= 1, got {value}")


@attrs.frozen(kw_only=True)
class AttentionSpec:
    """A layer that stores a key and a value vector per token and KV head.

    Its policy says both which tokens stay resident and which keys its queries attend: a
    query at position p reads ``policy.live_spans(p)`` and itself, nothing else.

    Attributes:
        name: The layer's name in the checkpoint (``model.layers.3.self_attn``).
        policy: What the layer keeps and attends.
        num_kv_heads: Key/value heads.
        head_dim: Width of one head.
        dtype_bytes: Bytes per cached value.
        kind: The config's layer type (``full_attention``, ``sliding_attention``, ...), or
            None for a spec not read from a config. Models key per-kind settings by it
            (rope parameters, user policy choices); the layout ignores it.
        reads: The name of an earlier layer whose pages this layer attends instead of
            keeping its own (Gemma 4's KV-shared layers), or None. Such a layer owns no
            memory: the planner leaves it out, and it reads its owner's slot and group.
        beside: A second memory of the layer, kept in pages of its own: the state of a
            mixer that runs beside the attention on the same input (Falcon-H1's Mamba2),
            or the keys of an indexer that picks the tokens the attention reads (DeepSeek
            V3.2's, one ``latent`` vector a token), or None. The layout sees it as one
            more layer (``memories``). It may have a memory beside it in turn (DeepSeek
            V4: the window's keys, beside them the compressed entries, beside those the
            state of the tokens waiting for their entry).
        latent: The layer keeps one ``head_dim`` vector per token and KV head, from which
            its keys and values both come (multi-head latent attention: DeepSeek V3's
            compressed latent beside its rope key), not a key and a value.
    """

    name: str
    policy: MemoryPolicy
    num_kv_heads: int = attrs.field(validator=_at_least_one)
    head_dim: int = attrs.field(validator=_at_least_one)
    dtype_bytes: int = attrs.field(validator=_at_least_one)
    kind: str | None = None
    reads: str | None = None
    beside: StateSpec | AttentionSpec | None = None
    latent: bool = False

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one page of this layer: K and V (or the latent) of ``block_size``
        tokens (of the positions its policy keeps for them: ``page_positions``)."""
        vectors = 1 if self.latent else 2
        positions = self.policy.page_positions(block_size)
        return vectors * self.num_kv_heads * self.head_dim * self.dtype_bytes * positions


@attrs.frozen(kw_only=True)
class StateSpec:
    """A recurrent (mamba-like) layer: one fixed-size state per page, whatever the block.

    ``kind`` is the config's layer type (``mamba``), or None, as for :class:`AttentionSpec`.
    """

    name: str
    policy: MemoryPolicy
    state_bytes: int = attrs.field(validator=_at_least_one)
    kind: str | None = None

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one page of this layer: one state."""
        return self.state_bytes


@attrs.frozen(kw_only=True)
class NoCacheSpec:
    """A layer that keeps nothing per request (Nemotron-H's MLP and MoE layers): the
    planner never sees it, and it runs without a cache.

    ``kind`` is the config's layer type (``mlp``), as for :class:`AttentionSpec`.
    """

    name: str
    kind: str | None = None


#: What a layer keeps in the pool: K/V, or a state.
LayerSpec = AttentionSpec | StateSpec
#: A model's layer: one that keeps K/V or a state, or one that keeps nothing.
ModelLayer = AttentionSpec | StateSpec | NoCacheSpec


def memories(layers: Iterable[ModelLayer]) -> list[LayerSpec | NoCacheSpec]:
    """Each memory of ``layers``, in layer order: a layer's spec, followed by the memories
    beside it where its attention has them (``AttentionSpec.beside``, and theirs). The
    executor keeps a cache per memory; the planner sizes those that keep something
    (``cached_layers``).
    """
    out: list[LayerSpec | NoCacheSpec] = []
    for layer in layers:
        spec: LayerSpec | NoCacheSpec | None = layer
        while spec is not None:
            out.append(spec)
            spec = spec.beside if isinstance(spec, AttentionSpec) else None
    return out


def cached_layers(layers: Iterable[ModelLayer]) -> list[LayerSpec]:
    """The memories of ``layers`` that keep something in the pool, in order."""
    return [s for s in memories(layers) if not isinstance(s, NoCacheSpec)]


def page_owner(spec: ModelLayer) -> str:
    """The name of the layer whose pages ``spec``'s layer reads: its own, or for a layer
    that reads another's cache (``AttentionSpec.reads``), that layer's."""
    return spec.reads if isinstance(spec, AttentionSpec) and spec.reads else spec.name


def owns_pages(spec: ModelLayer) -> bool:
    """Whether the layer keeps pages of its own (every layer but those reading another's
    and those keeping nothing)."""
    return not isinstance(spec, NoCacheSpec) and page_owner(spec) == spec.name


def _policy_tuple(policies: Iterable[MemoryPolicy]) -> tuple[MemoryPolicy, ...]:
    # A typed converter: mypy reads attrs' converter=tuple as taking Iterable[_T_co].
    return tuple(policies)


@attrs.frozen
class PoolSpec:
    """The shape of the shared block pool: what the engine and its executor must agree on.

    The executor allocates its caches for it and reports it; the engine's KV cache
    manager is built from the same value, so the two cannot describe different pools.

    Attributes:
        policies: The memory policy of each KV group, in group order.
        num_blocks: Blocks in the pool, the null block 0 included.
        block_size: Tokens per block, the same for every group.
        state_span: Page ids one page of a state group takes (``hybridkv.memory.spans``);
            1: every page is one id.
    """

    policies: tuple[MemoryPolicy, ...] = attrs.field(converter=_policy_tuple)
    num_blocks: int
    block_size: int
    state_span: int = 1


@attrs.frozen(kw_only=True)
class KVGroup:
    """Layers that share one block table per request (``layer_slots`` says where each lives)."""

    group_id: int
    policy: MemoryPolicy
    layer_names: tuple[str, ...]


@attrs.frozen(kw_only=True)
class LayoutPlan:
    """How the KV byte budget is spent.

    Attributes:
        block_size: Tokens per block (every group uses the same).
        num_blocks: Pages in the pool, the null page 0 included.
        block_bytes: Bytes of one page in one slot: the largest K/V layer's page
            (a state page is ``state_span`` of them).
        groups: The KV groups, ``group_id`` equal to the position.
        group_size: Slots to allocate per device: the layers per group without
            pipeline stages, the largest stage's count with them.
        layer_slots: Layer name -> (group id, slot), the slot local to the layer's stage
            (layers whose pages are a fraction of ``block_bytes`` may share a slot; a
            state's: the last slot it reaches).
        layer_offsets: Layer name -> byte offset of its page within its slot's page, for
            the layers packed after the first into a slot, or of a state within its
            group's state page (its span over every slot); absent: 0.
        budget_bytes: The budget the plan was made for.
        padding_bytes: Bytes lost to unified page sizes and empty slots, over the pool.
        uniform_num_blocks: Pages a uniform allocator (every layer as full attention in
            one group) would fit in the same bytes, with its own page size.
        stages: Per pipeline stage, the layer names it holds (one stage without PP).
        state_span: Pages one state page takes: a state larger than a K/V page gets a
            span of them (``hybridkv.memory.spans``) rather than raising the block size.
    """

    block_size: int
    num_blocks: int
    block_bytes: int
    groups: tuple[KVGroup, ...]
    group_size: int
    layer_slots: dict[str, tuple[int, int]]
    budget_bytes: int
    padding_bytes: int
    uniform_num_blocks: int
    stages: tuple[tuple[str, ...], ...] = ()
    state_span: int = 1
    layer_offsets: dict[str, int] = attrs.field(factory=dict)

    def slot_of(self, spec: LayerSpec) -> tuple[int, int]:
        """``(group id, slot)`` of the pages the layer of ``spec`` reads (its owner's, for a
        layer reading another's cache)."""
        return self.layer_slots[page_owner(spec)]

    def offset_of(self, spec: LayerSpec) -> int:
        """Byte offset of the layer's page (its owner's) within its slot's page, or of a
        state within its group's state page."""
        return self.layer_offsets.get(page_owner(spec), 0)

    @property
    def policies(self) -> tuple[MemoryPolicy, ...]:
        """The policy of each group, in group order (what the KV cache manager takes)."""
        return tuple(g.policy for g in self.groups)

    @property
    def pool(self) -> PoolSpec:
        """The pool this plan sized."""
        return PoolSpec(self.policies, self.num_blocks, self.block_size, self.state_span)

    @property
    def state_page_bytes(self) -> int:
        """Bytes of one state page in one slot (its span of pages)."""
        return self.state_span * self.block_bytes

    @property
    def pool_bytes(self) -> int:
        """Bytes the KV pool takes: every slot of every page."""
        return self.num_blocks * self.group_size * self.block_bytes
