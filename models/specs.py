"""Per-layer specs from a Hugging Face config.json: the one parse of a model's layers.

Each layer's kind, memory policy, KV heads, head dim, window or chunk, and mamba state
shape are read here and nowhere else: the layout planner sizes the pool from these specs,
the KV cache manager follows their policies, and the model's attention layers attend by
them (``ModelConfig.layers``). This module imports no torch, so ``hybridkv plan`` uses it
on configs of models it never loads.

Layer kinds come from the model's family (``hybridkv.models.families``: ``layer_types``
first, else the family's own pattern), or, for a ``model_type`` no family knows, from
``layer_types`` alone. A state layer's (``mamba``, ``deltanet``) is sized by its family.

A kind's policy follows from the config (``full_attention``: full, ``sliding_attention``:
a window of ``sliding_window``, ``chunked_attention``: chunks of ``attention_chunk_size``)
unless the caller chooses another for that kind (``policies``). Layer names follow the
checkpoint: ``model.layers.{i}.self_attn`` (``.mamba``, ``.linear_attn`` for states).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, overload

import attrs

from hybridkv.memory.layout import AttentionSpec, LayerSpec, ModelLayer, NoCacheSpec, StateSpec
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.families import MODULES, Family, family_for, normalized
from hybridkv.models.hf_config import int_field, text_config
from hybridkv.models.kinds import (
    CHUNKED,
    FULL,
    LAYER_TYPES,
    MAMBA,
    NO_CACHE_KINDS,
    SIDE_BY_SIDE,
    SLIDING,
    STATE_KINDS,
    PolicyChoices,
    layer_types_kinds,
    pattern_layer_types,
)
from hybridkv.models.shapes.compressed import CSA, HCA
from hybridkv.models.shapes.latent import latent_shape
from hybridkv.models.shapes.state import StateShape
from hybridkv.policies import MemoryPolicy, check_policy, make_policy

__all__ = [
    "CHUNKED",
    "FULL",
    "LAYER_TYPES",
    "MAMBA",
    "SLIDING",
    "PolicyChoices",
    "layer_specs_from_config",
    "pattern_layer_types",
    "tensor_rank_spec",
]


@overload
def tensor_rank_spec(spec: LayerSpec, size: int, state: StateShape | None) -> LayerSpec: ...
@overload
def tensor_rank_spec(spec: ModelLayer, size: int, state: StateShape | None) -> ModelLayer: ...
def tensor_rank_spec(spec: ModelLayer, size: int, state: StateShape | None) -> ModelLayer:
    """``spec`` as each of ``size`` tensor-parallel ranks holds it
    (``hybridkv.parallel.tensor_shards``): its share of the KV heads, or one replicated
    head where there are fewer heads than ranks; a state layer's state (of shape
    ``state``) of its share of the heads and channels (the state beside an attention
    layer's too)."""
    if isinstance(spec, AttentionSpec):
        beside = None if spec.beside is None else _beside_share(spec.beside, size, state)
        return attrs.evolve(spec, num_kv_heads=max(1, spec.num_kv_heads // size), beside=beside)
    return spec if isinstance(spec, NoCacheSpec) else _beside_share(spec, size, state)


def _beside_share(
    spec: StateSpec | AttentionSpec, size: int, state: StateShape | None
) -> StateSpec | AttentionSpec:
    if isinstance(spec, AttentionSpec):  # an indexer's keys, compressed entries: whole
        beside = None if spec.beside is None else _beside_share(spec.beside, size, state)
        return attrs.evolve(spec, beside=beside)
    if state is None:
        return spec
    return attrs.evolve(spec, state_bytes=state.tensor_share(size).state_bytes)


def layer_specs_from_config(
    config: Mapping[str, Any], dtype_bytes: int = 2, *, policies: PolicyChoices | None = None
) -> list[ModelLayer]:
    """One spec per layer of a Hugging Face config dict, in layer order (a layer keeping
    nothing, such as Nemotron-H's MLP layers, as a ``NoCacheSpec``; one running attention
    and a state side by side, Falcon-H1's, as an attention spec with its state beside).

    Args:
        config: The parsed config.json (a multimodal config's ``text_config`` is used).
        dtype_bytes: Bytes per cached value (2 for bfloat16).
        policies: Per layer kind (``full_attention``, ...), the memory policy its layers
            keep and attend instead of the config's (for ``mamba``, a state policy such as
            ``MambaLike(checkpoint_every=4)``). Layers of one kind share one policy object.

    Raises:
        ModelConfigError: a missing or bad field, a layer type or model type we cannot
            size, or a chosen policy for a kind of layer the model does not have.
        PolicyError: a window or chunk the policy rejects (such as 0), or a chosen policy
            that is not a MemoryPolicy.
    """
    cfg: Mapping[str, Any] = text_config(config)
    family = family_for(cfg["model_type"])
    cfg = normalized(family, cfg)
    num_layers = int_field(cfg, "num_hidden_layers")
    kinds = _layer_kinds(cfg, num_layers, family)
    chosen = _check_choices(policies or {}, kinds)
    by_kind: dict[str, MemoryPolicy] = {}
    specs: list[ModelLayer] = []

    def spec(kind: str, layer: int) -> LayerSpec:
        if kind not in by_kind:
            by_kind[kind] = chosen[kind] if kind in chosen else _policy(cfg, kind)
        return _spec(cfg, family, kind, layer, by_kind[kind], dtype_bytes)

    for i, kind in enumerate(kinds):
        if kind in NO_CACHE_KINDS:
            specs.append(NoCacheSpec(name=f"model.layers.{i}.mlp", kind=kind))
        elif kind in SIDE_BY_SIDE:
            attention, state = (spec(k, i) for k in SIDE_BY_SIDE[kind])
            assert isinstance(attention, AttentionSpec) and isinstance(state, StateSpec)
            specs.append(attrs.evolve(attention, beside=state))
        else:
            specs.append(spec(kind, i))
    if family is not None and family.shared_kv is not None:
        specs = _shared(specs, family.shared_kv(cfg, kinds))
    return specs


def _shared(specs: list[ModelLayer], owners: Mapping[int, int]) -> list[ModelLayer]:
    """``specs`` with each layer of ``owners`` reading its owner's pages: an earlier
    attention layer of the same kind and shape that keeps its own."""
    out = list(specs)
    for reader, owner in owners.items():
        spec, source = specs[reader], specs[owner]
        same = isinstance(spec, AttentionSpec) and isinstance(source, AttentionSpec)
        if not same or owner >= reader or owner in owners or spec.kind != source.kind:
            raise ModelConfigError(
                f"layer {reader} cannot read the KV cache of layer {owner}: a layer reads "
                "an earlier attention layer of its own kind that keeps its own"
            )
        assert isinstance(spec, AttentionSpec) and isinstance(source, AttentionSpec)
        same_shape = (spec.num_kv_heads, spec.head_dim) == (source.num_kv_heads, source.head_dim)
        if not same_shape:
            raise ModelConfigError(f"layer {reader} reads layer {owner}'s cache of another shape")
        out[reader] = attrs.evolve(spec, reads=source.name)
    return out


def _layer_kinds(cfg: Mapping[str, Any], num_layers: int, family: Family | None) -> list[str]:
    if family is not None:
        return family.layer_kinds(cfg, num_layers)
    if cfg.get("layer_types") is None:
        raise ModelConfigError(
            f"model_type {cfg['model_type']!r} has no layer_types and is not one we know "
            f"({', '.join(MODULES)})"
        )
    return layer_types_kinds(cfg, num_layers)


def _check_choices(policies: PolicyChoices, kinds: list[str]) -> dict[str, MemoryPolicy]:
    """``policies``, once every key is a kind of the model and every value a policy that
    keeps what the kind needs (a state for ``mamba``, K/V for attention kinds). A layer
    running two mixers side by side has both kinds (Falcon-H1's ``hybrid``: attention
    and ``mamba``), each chosen for on its own."""
    present = list(dict.fromkeys(k for kind in kinds for k in SIDE_BY_SIDE.get(kind, (kind,))))
    for kind in policies:
        if kind not in present:
            raise ModelConfigError(
                f"a policy is chosen for layer kind {kind!r}, but the model has no layers of "
                f"that kind; its kinds: {', '.join(present) or 'none'}"
            )
    chosen = {
        kind: check_policy(p, f"the policy chosen for {kind!r}") for kind, p in policies.items()
    }
    for kind, policy in chosen.items():
        if kind in NO_CACHE_KINDS:
            raise ModelConfigError(
                f"a policy is chosen for layer kind {kind!r}, whose layers keep nothing"
            )
        if policy.keeps_state != (kind in STATE_KINDS):
            need = f"keeps a state ({kind})" if kind in STATE_KINDS else "keeps K/V"
            raise ModelConfigError(
                f"the policy chosen for layer kind {kind!r} must be one that {need}, got {policy!r}"
            )
    return chosen


def _policy(cfg: Mapping[str, Any], kind: str) -> MemoryPolicy:
    if kind == FULL:
        return make_policy("full")
    if kind == SLIDING:
        return make_policy("sliding_window", window=int_field(cfg, "sliding_window"))
    if kind in (CSA, HCA):  # DeepSeek V4: the window beside the compressed entries
        return make_policy("sliding_window", window=int_field(cfg, "sliding_window"))
    if kind == CHUNKED:
        return make_policy("chunked_local", chunk=int_field(cfg, "attention_chunk_size"))
    assert kind in STATE_KINDS, kind  # _layer_kinds refused every other kind
    return make_policy("mamba")


def _spec(
    cfg: Mapping[str, Any],
    family: Family | None,
    kind: str,
    layer: int,
    policy: MemoryPolicy,
    dtype_bytes: int,
) -> LayerSpec:
    if kind in STATE_KINDS:
        assert family is not None and family.state_shape is not None, "a state from a family"
        state_bytes = family.state_shape(cfg).state_bytes
        name = f"model.layers.{layer}.{STATE_KINDS[kind]}"
        return StateSpec(name=name, policy=policy, state_bytes=state_bytes, kind=kind)
    name = f"model.layers.{layer}.self_attn"
    if family is not None and family.latent_width is not None:
        width, index = family.latent_width(cfg), latent_shape(cfg).index_head_dim
        indexer = None
        if index:  # DeepSeek V3.2: the indexer's keys, one a token, in pages of their own
            indexer = AttentionSpec(
                name=f"{name}.indexer", policy=policy, num_kv_heads=1, head_dim=index,
                dtype_bytes=dtype_bytes, kind=kind, latent=True,
            )  # fmt: skip
        return AttentionSpec(
            name=name, policy=policy, num_kv_heads=1, head_dim=width, dtype_bytes=dtype_bytes,
            kind=kind, latent=True, beside=indexer,
        )  # fmt: skip
    num_heads = int_field(cfg, "num_attention_heads")
    if family is not None and family.kv_shape is not None:
        kv_heads, head_dim = family.kv_shape(cfg, kind)
    else:
        kv_heads = int_field(cfg, "num_key_value_heads", num_heads)
        head_dim = _head_dim(cfg)
    spec = AttentionSpec(
        name=name,
        policy=policy,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype_bytes=dtype_bytes,
        kind=kind,
    )
    return spec if family is None or family.beside is None else family.beside(cfg, spec)


def _head_dim(cfg: Mapping[str, Any]) -> int:
    if cfg.get("head_dim") is not None:
        return int_field(cfg, "head_dim")
    return int_field(cfg, "hidden_size") // int_field(cfg, "num_attention_heads")
