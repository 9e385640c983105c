"""Gemma 4 (text): Gemma 3's sandwich layers, 5 sliding to 1 full (the last full), full
layers of their own head width and KV heads whose values may be the keys' projection
(``attention_k_eq_v``), values RMS-normalised, scores unscaled, proportional rope; the last
``num_kv_shared_layers`` layers read the cache of the last earlier layer of their kind
(their MLP twice as wide under ``use_double_wide_mlp``); per-layer inputs (PLE); experts
beside the dense MLP (``enable_moe_block``); a learned scale per layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.families import Family
from hybridkv.models.families.gemma2 import gemma_fields
from hybridkv.models.hf_config import flag_field, int_field, kind_overrides, optional_float_field
from hybridkv.models.kinds import (
    FULL,
    SLIDING,
    PolicyChoices,
    kinds_by,
    pattern_layer_types,
    shared_tail,
)
from hybridkv.models.shapes.decoder import SANDWICH, PerLayerInputs
from hybridkv.models.shapes.moe import ExpertsShape
from hybridkv.models.shapes.rope import rope_by_kind

#: The rope of a config that names none (transformers' default).
_ROPE = {
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
}
#: The per-layer inputs' parts, named on the backbone in the checkpoint -> ours.
_PER_LAYER = ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")


def parse_gemma4(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Gemma 4 text config.json (``gemma4_text``)."""
    if hf.get("use_bidirectional_attention") == "all":
        raise ModelConfigError("use_bidirectional_attention='all' is not supported (causal only)")
    hf = {**hf, "rope_parameters": hf.get("rope_parameters") or _ROPE}
    fields = gemma_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    readers = frozenset(i for i, s in enumerate(fields["layers"]) if getattr(s, "reads", None))
    width = int(hf.get("hidden_size_per_layer_input") or 0)
    return ModelConfig(
        **{**fields, "norm_offset": 0.0, "query_scale": 1.0},
        norm_scale_first=True,
        qk_norm=True,
        value_norm=True,
        attn_softcap=None,
        final_softcap=optional_float_field(hf, "final_logit_softcapping", None),
        rope=rope_by_kind(hf, (FULL, SLIDING), default_theta=10_000.0),
        values_from_keys=frozenset({FULL} if flag_field(hf, "attention_k_eq_v", False) else ()),
        per_layer_inputs=PerLayerInputs(
            width=width,
            vocab_size=int_field(hf, "vocab_size_per_layer_input", fields["vocab_size"]),
        )
        if width
        else None,
        layer_scalar=True,
        wide_mlp_layers=readers if flag_field(hf, "use_double_wide_mlp", False) else frozenset(),
        experts=_experts(hf),
    )


def _experts(hf: Mapping[str, Any]) -> ExpertsShape | None:
    """The experts beside every layer's MLP (``enable_moe_block``), or None."""
    if not flag_field(hf, "enable_moe_block", False):
        return None
    return ExpertsShape(
        num_experts=int_field(hf, "num_experts"),
        top_k=int_field(hf, "top_k_experts"),
        inner=int_field(hf, "moe_intermediate_size"),
        activation="gelu_tanh",
        stacks="plain",
        router_norm_eps=float(hf.get("rms_norm_eps") or 1e-6),
        expert_scales=True,
    )


_PATTERN = kinds_by(lambda cfg, n: list(pattern_layer_types(n, 6)))


def _kinds(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """``layer_types``, else every sixth layer full; the last full whatever they say (as
    transformers forces it)."""
    return [*_PATTERN(cfg, num_layers)[:-1], FULL]


def _kv_shape(cfg: Mapping[str, Any], kind: str) -> tuple[int, int]:
    """``num_key_value_heads`` of ``head_dim``, but where ``per_layer_config`` says
    otherwise for the kind; without it, full layers have heads of ``global_head_dim``
    (512) and, with ``attention_k_eq_v``, ``num_global_key_value_heads`` of them."""
    heads, dim = int_field(cfg, "num_key_value_heads"), int_field(cfg, "head_dim")
    if cfg.get("per_layer_config"):
        kinds = _kinds(cfg, int_field(cfg, "num_hidden_layers"))
        found = kind_overrides(cfg, kinds, kind, ("head_dim", "num_key_value_heads"))
        return int(found.get("num_key_value_heads", heads)), int(found.get("head_dim", dim))
    if kind != FULL:
        return heads, dim
    if flag_field(cfg, "attention_k_eq_v", False):
        heads = int_field(cfg, "num_global_key_value_heads", heads)
    return heads, int_field(cfg, "global_head_dim", 512)


FAMILY = Family(
    model_types=("gemma4_text",),
    layer_kinds=_kinds,
    parse=parse_gemma4,
    decoder=attrs.evolve(SANDWICH, mlp="dense_and_experts"),
    renames={f"model.{n}.weight": f"model.per_layer_inputs.{n}.weight" for n in _PER_LAYER},
    kv_shape=_kv_shape,
    shared_kv=lambda cfg, kinds: shared_tail(kinds, cfg.get("num_kv_shared_layers") or 0),
    # The multimodal config (its text model nested in ``text_config``) is sized, not run.
    sized_types=("gemma4",),
)
