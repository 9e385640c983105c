"""Layer specs for the layout planner from a Hugging Face config.json, and built-in models.

Only the numbers that size the KV cache are read (layer kinds, KV heads, head dim, window,
mamba state shapes), so this module imports no torch: the ``hybridkv plan`` command uses
it on configs of models it never loads.

Layer kinds come from ``layer_types`` when a config has it (any model type), else from
the model type:

============  ===========================================================================
llama         every layer full attention
mistral       every layer sliding (``sliding_window``) when set, else full
mixtral       as mistral
gemma2        even layers (0, 2, ...) sliding, odd layers full
gemma3_text   every ``sliding_window_pattern``-th layer full (default 6), the rest sliding
gemma3        as gemma3_text, read from the nested ``text_config``
jamba         layer i attention when ``i % attn_layer_period == attn_layer_offset``, else
              mamba, with a state of ``d_inner * (d_conv + d_state)`` values
============  ===========================================================================

Layer names follow the checkpoint: ``model.layers.{i}.self_attn`` (``.mamba`` for state).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.memory.layout import AttentionSpec, LayerSpec, StateSpec
from hybridkv.models.errors import ModelConfigError
from hybridkv.policies import MemoryPolicy, make_policy

#: ``layer_types`` entries we can size, and the policy each maps to.
LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


FULL = "full_attention"
SLIDING = "sliding_attention"


def pattern_layer_types(num_layers: int, every: int) -> tuple[str, ...]:
    """Layer types for configs without ``layer_types``: every ``every``-th layer is full."""
    return tuple(FULL if (i + 1) % every == 0 else SLIDING for i in range(num_layers))


def layer_specs_from_config(config: Mapping[str, Any], dtype_bytes: int = 2) -> list[LayerSpec]:
    """One spec per KV layer of a Hugging Face config dict, in layer order.

    Args:
        config: The parsed config.json (a multimodal config's ``text_config`` is used).
        dtype_bytes: Bytes per cached value (2 for bfloat16).

    Raises:
        ModelConfigError: a missing field, a layer type or model type we cannot size.
        PolicyError: a window or chunk the policy rejects (such as 0).
    """
    text = config.get("text_config")
    given: Mapping[str, Any] = text if isinstance(text, Mapping) else config
    model_type = str(given.get("model_type") or config.get("model_type") or "")
    # Fields config.json may leave out, as transformers' config classes fill them in.
    cfg = {**_DEFAULTS.get(model_type, {}), **given}
    num_layers = _int(cfg, "num_hidden_layers")
    if cfg.get("layer_types") is not None:
        kinds = [str(k) for k in cfg["layer_types"]]
    elif model_type in ("llama", "mistral", "mixtral"):
        kind = SLIDING if cfg.get("sliding_window") else FULL
        kinds = [kind] * num_layers
    elif model_type == "gemma2":
        kinds = list(pattern_layer_types(num_layers, 2))
    elif model_type in ("gemma3", "gemma3_text"):
        kinds = list(pattern_layer_types(num_layers, _int(cfg, "sliding_window_pattern")))
    elif model_type == "jamba":
        return _jamba_specs(cfg, num_layers, dtype_bytes)
    else:
        raise ModelConfigError(
            f"model_type {model_type!r} has no layer_types and is not one we know "
            "(llama, mistral, mixtral, gemma2, gemma3, gemma3_text, jamba)"
        )
    if len(kinds) != num_layers:
        raise ModelConfigError(
            f"layer_types has {len(kinds)} entries, num_hidden_layers is {num_layers}"
        )
    num_heads = _int(cfg, "num_attention_heads")
    num_kv_heads = _int(cfg, "num_key_value_heads", num_heads)
    head_dim = _head_dim(cfg, num_heads)
    return [
        AttentionSpec(
            name=f"model.layers.{i}.self_attn",
            policy=_policy(cfg, kind, i),
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype_bytes=dtype_bytes,
        )
        for i, kind in enumerate(kinds)
    ]


_GEMMA: dict[str, Any] = {
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "sliding_window": 4096,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 4096},
    "gemma2": _GEMMA,
    "gemma3_text": {**_GEMMA, "sliding_window_pattern": 6},
    "gemma3": {**_GEMMA, "sliding_window_pattern": 6},
}


def _policy(cfg: Mapping[str, Any], kind: str, layer: int) -> MemoryPolicy:
    if kind == "full_attention":
        return make_policy("full")
    if kind == "sliding_attention":
        return make_policy("sliding_window", window=_int(cfg, "sliding_window"))
    if kind == "chunked_attention":
        return make_policy("chunked_local", chunk=_int(cfg, "attention_chunk_size"))
    raise ModelConfigError(
        f"layer {layer} has layer type {kind!r}; supported: {', '.join(LAYER_TYPES)}"
    )


def _jamba_specs(cfg: Mapping[str, Any], num_layers: int, dtype_bytes: int) -> list[LayerSpec]:
    period = _int(cfg, "attn_layer_period", 8)
    offset = _int(cfg, "attn_layer_offset", 4)
    full = make_policy("full")
    num_heads = _int(cfg, "num_attention_heads")
    hidden = _int(cfg, "hidden_size")
    # A mamba layer keeps its convolution window and its SSM state, d_inner channels each.
    d_inner = _int(cfg, "mamba_expand", 2) * hidden
    state_values = d_inner * (_int(cfg, "mamba_d_conv", 4) + _int(cfg, "mamba_d_state", 16))
    specs: list[LayerSpec] = []
    for i in range(num_layers):
        if i % period == offset:
            specs.append(
                AttentionSpec(
                    name=f"model.layers.{i}.self_attn",
                    policy=full,
                    num_kv_heads=_int(cfg, "num_key_value_heads", num_heads),
                    head_dim=_head_dim(cfg, num_heads),
                    dtype_bytes=dtype_bytes,
                )
            )
        else:
            specs.append(
                StateSpec(
                    name=f"model.layers.{i}.mamba",
                    policy=make_policy("mamba"),
                    state_bytes=state_values * dtype_bytes,
                )
            )
    return specs


def _head_dim(cfg: Mapping[str, Any], num_heads: int) -> int:
    if cfg.get("head_dim") is not None:
        return _int(cfg, "head_dim")
    return _int(cfg, "hidden_size") // num_heads


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """``cfg[key]`` as a positive int (``default`` when absent or null)."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise ModelConfigError(f"config lacks the field {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelConfigError(f"config field {key!r} must be an integer >= 1, got {value!r}")
    return value


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
}
