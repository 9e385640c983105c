"""Per-layer specs from a Hugging Face config.json: the one parse of a model's layers.

Each layer's kind, memory policy, KV heads, head dim, window or chunk, and mamba state
shape are read here and nowhere else: the layout planner sizes the pool from these specs,
the KV cache manager follows their policies, and the model's attention layers attend by
them (``ModelConfig.layers``). This module imports no torch, so ``hybridkv plan`` uses it
on configs of models it never loads.

Layer kinds come from ``layer_types`` when a config has it (any model type), else from
the model type:

============  ===========================================================================
llama         every layer full attention
mistral       every layer sliding (``sliding_window``) when set, else full
mixtral       as mistral
gemma2        even layers (0, 2, ...) sliding, odd layers full
gemma3_text   every ``sliding_window_pattern``-th layer full (``_sliding_window_pattern``
              when only that is given, default 6), the rest sliding
gemma3        as gemma3_text, read from the nested ``text_config``
jamba         layer i attention when ``i % attn_layer_period == attn_layer_offset``, else
              mamba, with a state of ``d_inner * (d_conv + d_state)`` values
bamba         layers in ``attn_layer_indices`` full attention, the rest Mamba2
granitemoe-   ``layer_types``: ``attention``/``full_attention`` is full attention,
hybrid        ``mamba``/``linear_attention`` Mamba2
============  ===========================================================================

A Mamba2 layer's state (float32 conv and SSM state) is sized by
``hybridkv.models.state_shapes``.

A kind's policy follows from the config (``full_attention``: full, ``sliding_attention``:
a window of ``sliding_window``, ``chunked_attention``: chunks of ``attention_chunk_size``)
unless the caller chooses another for that kind (``policies``). Layer names follow the
checkpoint: ``model.layers.{i}.self_attn`` (``.mamba`` for state).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hybridkv.memory.layout import AttentionSpec, LayerSpec, StateSpec
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.hf_config import int_field, text_config
from hybridkv.models.state_shapes import Mamba2Shape, mamba2_shape
from hybridkv.policies import MemoryPolicy, check_policy, make_policy

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"
MAMBA = "mamba"

#: ``layer_types`` entries we can size.
LAYER_TYPES = (FULL, SLIDING, CHUNKED)

#: Hybrid Mamba2 models whose state layers we size from ``mamba_*`` fields.
MAMBA2_MODEL_TYPES = ("bamba", "granitemoehybrid")

#: Granite 4.0-H ``layer_types`` names, by kind (transformers writes the second of each).
_GRANITE_KINDS = {
    "attention": FULL,
    "full_attention": FULL,
    "mamba": MAMBA,
    "linear_attention": MAMBA,
}

#: A memory policy per layer kind, chosen in place of the one the config implies.
PolicyChoices = Mapping[str, MemoryPolicy]


def tensor_rank_spec(spec: LayerSpec, size: int, mamba: Mamba2Shape | None) -> LayerSpec:
    """``spec`` as each of ``size`` tensor-parallel ranks holds it
    (``hybridkv.parallel.tensor_shards``): its share of the KV heads, or one replicated
    head where there are fewer heads than ranks; a Mamba2 state (shape ``mamba``) of its
    share of the heads and channels. Other states are not split."""
    if isinstance(spec, AttentionSpec):
        return attrs.evolve(spec, num_kv_heads=max(1, spec.num_kv_heads // size))
    if mamba is None:
        return spec
    return attrs.evolve(spec, state_bytes=mamba.tensor_share(size).state_bytes)


def pattern_layer_types(num_layers: int, every: int) -> tuple[str, ...]:
    """Layer types for configs without ``layer_types``: every ``every``-th layer is full."""
    return tuple(FULL if (i + 1) % every == 0 else SLIDING for i in range(num_layers))


def layer_specs_from_config(
    config: Mapping[str, Any], dtype_bytes: int = 2, *, policies: PolicyChoices | None = None
) -> list[LayerSpec]:
    """One spec per KV layer of a Hugging Face config dict, in layer order.

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
    cfg = text_config(config)
    num_layers = int_field(cfg, "num_hidden_layers")
    kinds = _layer_kinds(cfg, num_layers)
    chosen = _check_choices(policies or {}, kinds)
    by_kind: dict[str, MemoryPolicy] = {}
    specs: list[LayerSpec] = []
    for i, kind in enumerate(kinds):
        if kind not in by_kind:
            by_kind[kind] = chosen[kind] if kind in chosen else _policy(cfg, kind)
        specs.append(_spec(cfg, kind, i, by_kind[kind], dtype_bytes))
    return specs


def _layer_kinds(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    model_type = cfg["model_type"]
    if model_type == "granitemoehybrid":
        names = [str(k) for k in cfg.get("layer_types") or ["mamba"] * num_layers]
        return _named_kinds(names, num_layers, _GRANITE_KINDS)
    if cfg.get("layer_types") is not None:
        kinds = [str(k) for k in cfg["layer_types"]]
    elif model_type in ("llama", "mistral", "mixtral"):
        kinds = [SLIDING if cfg.get("sliding_window") else FULL] * num_layers
    elif model_type == "gemma2":
        kinds = list(pattern_layer_types(num_layers, 2))
    elif model_type in ("gemma3", "gemma3_text"):
        kinds = list(pattern_layer_types(num_layers, _gemma3_pattern(cfg)))
    elif model_type == "jamba":
        period = int_field(cfg, "attn_layer_period", 8)
        offset = int_field(cfg, "attn_layer_offset", 4)
        return [FULL if i % period == offset else MAMBA for i in range(num_layers)]
    elif model_type == "bamba":
        attention = set(cfg.get("attn_layer_indices") or ())
        return [FULL if i in attention else MAMBA for i in range(num_layers)]
    else:
        raise ModelConfigError(
            f"model_type {model_type!r} has no layer_types and is not one we know "
            "(llama, mistral, mixtral, gemma2, gemma3, gemma3_text, jamba, bamba, "
            "granitemoehybrid)"
        )
    return _named_kinds(kinds, num_layers, {k: k for k in LAYER_TYPES})


def _named_kinds(names: list[str], num_layers: int, kinds: Mapping[str, str]) -> list[str]:
    """Each layer's kind from its ``layer_types`` name, once the count and names check."""
    if len(names) != num_layers:
        raise ModelConfigError(
            f"layer_types has {len(names)} entries, num_hidden_layers is {num_layers}"
        )
    for i, name in enumerate(names):
        if name not in kinds:
            raise ModelConfigError(
                f"layer {i} has layer type {name!r}; supported: {', '.join(kinds)}"
            )
    return [kinds[name] for name in names]


def _gemma3_pattern(cfg: Mapping[str, Any]) -> int:
    # transformers reads sliding_window_pattern and writes it under both names; a file
    # holding only the private name still means its own pattern, not the default.
    if cfg.get("sliding_window_pattern") is not None:
        return int_field(cfg, "sliding_window_pattern")
    return int_field(cfg, "_sliding_window_pattern", 6)


def _check_choices(policies: PolicyChoices, kinds: list[str]) -> dict[str, MemoryPolicy]:
    """``policies``, once every key is a kind of the model and every value a policy that
    keeps what the kind needs (a state for ``mamba``, K/V for attention kinds)."""
    present = list(dict.fromkeys(kinds))
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
        if policy.keeps_state != (kind == MAMBA):
            need = "keeps a state (mamba)" if kind == MAMBA else "keeps K/V"
            raise ModelConfigError(
                f"the policy chosen for layer kind {kind!r} must be one that {need}, got {policy!r}"
            )
    return chosen


def _policy(cfg: Mapping[str, Any], kind: str) -> MemoryPolicy:
    if kind == FULL:
        return make_policy("full")
    if kind == SLIDING:
        return make_policy("sliding_window", window=int_field(cfg, "sliding_window"))
    if kind == CHUNKED:
        return make_policy("chunked_local", chunk=int_field(cfg, "attention_chunk_size"))
    assert kind == MAMBA, kind  # _layer_kinds refused every other kind
    return make_policy("mamba")


def _spec(
    cfg: Mapping[str, Any], kind: str, layer: int, policy: MemoryPolicy, dtype_bytes: int
) -> LayerSpec:
    if kind == MAMBA:
        if cfg["model_type"] in MAMBA2_MODEL_TYPES:
            state_bytes = mamba2_shape(cfg).state_bytes  # float32 whatever the model dtype
        else:
            # Jamba's Mamba1 state: its conv window and SSM state, d_inner channels each.
            d_inner = int_field(cfg, "mamba_expand", 2) * int_field(cfg, "hidden_size")
            width = int_field(cfg, "mamba_d_conv", 4) + int_field(cfg, "mamba_d_state", 16)
            state_bytes = d_inner * width * dtype_bytes
        return StateSpec(
            name=f"model.layers.{layer}.mamba", policy=policy, state_bytes=state_bytes, kind=kind
        )
    num_heads = int_field(cfg, "num_attention_heads")
    return AttentionSpec(
        name=f"model.layers.{layer}.self_attn",
        policy=policy,
        num_kv_heads=int_field(cfg, "num_key_value_heads", num_heads),
        head_dim=_head_dim(cfg),
        dtype_bytes=dtype_bytes,
        kind=kind,
    )


def _head_dim(cfg: Mapping[str, Any]) -> int:
    if cfg.get("head_dim") is not None:
        return int_field(cfg, "head_dim")
    return int_field(cfg, "hidden_size") // int_field(cfg, "num_attention_heads")


# -- built-in models ----------------------------------------------------------------------

#: Configs shaped like public checkpoints, for ``hybridkv plan NAME`` without a download.
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    # Gemma 3 1B: 26 layers, 5 sliding (window 512) to 1 full, one KV head of 256.
    "gemma3-like": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 26,
        "hidden_size": 1152,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
    },
    # Gemma 2 2B: 26 layers alternating sliding (window 4096) and full, 4 KV heads of 256.
    "gemma2-like": {
        "model_type": "gemma2",
        "num_hidden_layers": 26,
        "hidden_size": 2304,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 4096,
    },
    # Llama 3 8B: 32 full-attention layers, 8 KV heads of 128.
    "llama-like": {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    # Jamba v0.1: 32 layers, one attention layer in 8, the rest mamba.
    "jamba-like": {
        "model_type": "jamba",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "attn_layer_period": 8,
        "attn_layer_offset": 4,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    },
    # Bamba 9B: 32 layers, full attention in 3 (9, 18, 27), Mamba2 in the rest: 128 heads
    # of 64 channels, a state of 128, one group.
    "bamba-like": {
        "model_type": "bamba",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "attn_layer_indices": [9, 18, 27],
        "mamba_n_heads": 128,
        "mamba_d_head": 64,
        "mamba_d_state": 128,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    },
    # Granite 4.0-H Micro: 40 layers, full attention in 4 of them, Mamba2 in the rest.
    "granite-4.0-h-like": {
        "model_type": "granitemoehybrid",
        "num_hidden_layers": 40,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "layer_types": ["attention" if i % 10 == 9 else "mamba" for i in range(40)],
        "mamba_n_heads": 64,
        "mamba_d_head": 64,
        "mamba_d_state": 128,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    },
}
