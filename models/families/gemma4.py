"""Gemma 4 (text): Gemma 3's sandwich layers and 5 sliding : 1 full, with full layers of
their own head width and KV heads (``per_layer_config``, or ``global_head_dim`` and
``num_global_key_value_heads``), values that are the keys' projection in the full layers
(``attention_k_eq_v``) and always RMS-normalised, scores unscaled, proportional rope on a
quarter of each full head; the last ``num_kv_shared_layers`` layers read the cache of the
last earlier layer of their kind and keep none (their MLP twice as wide under
``use_double_wide_mlp``); per-layer inputs (PLE) where ``hidden_size_per_layer_input``;
experts beside the dense MLP where ``enable_moe_block``; a learned scale per layer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.families import Family
from hybridkv.models.families.common import common_fields
from hybridkv.models.families.gemma2 import gemma_activation
from hybridkv.models.hf_config import flag_field, int_field, optional_float_field
from hybridkv.models.kinds import (
    FULL,
    SLIDING,
    PolicyChoices,
    layer_types_kinds,
    pattern_layer_types,
)
from hybridkv.models.shapes.decoder import SANDWICH, PerLayerInputs
from hybridkv.models.shapes.moe import ExpertsShape
from hybridkv.models.shapes.rope import RopeSpec

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
        raise ModelConfigError(
            "use_bidirectional_attention='all' is not supported (causal attention only)"
        )
    fields = common_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    layers = fields["layers"]
    readers = frozenset(i for i, s in enumerate(layers) if getattr(s, "reads", None))
    max_positions = fields["max_position_embeddings"]
    params = hf.get("rope_parameters") or _ROPE
    fields["tie_word_embeddings"] = flag_field(hf, "tie_word_embeddings", True)
    return ModelConfig(
        **fields,
        norm_offset=0.0,
        norm_scale_first=True,
        activation=gemma_activation(hf),
        embed_scale=math.sqrt(fields["hidden_size"]),
        query_scale=1.0,
        mlp_bias=False,
        qk_norm=True,
        value_norm=True,
        attn_softcap=None,
        final_softcap=optional_float_field(hf, "final_logit_softcapping", None),
        rope={
            kind: RopeSpec.from_hf(params.get(kind), theta=10_000.0, max_positions=max_positions)
            for kind in (FULL, SLIDING)
        },
        values_from_keys=frozenset({FULL} if flag_field(hf, "attention_k_eq_v", False) else ()),
        per_layer_inputs=_per_layer_inputs(hf, fields["vocab_size"]),
        layer_scalar=True,
        wide_mlp_layers=readers if flag_field(hf, "use_double_wide_mlp", False) else frozenset(),
        experts=_experts(hf),
    )


def _per_layer_inputs(hf: Mapping[str, Any], vocab_size: int) -> PerLayerInputs | None:
    """The per-layer inputs (``hidden_size_per_layer_input`` wide), or None (0 or null)."""
    width = int(hf.get("hidden_size_per_layer_input") or 0)
    if not width:
        return None
    return PerLayerInputs(
        width=width, vocab_size=int_field(hf, "vocab_size_per_layer_input", vocab_size)
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


def _kinds(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """``layer_types``, else every sixth layer full; the last layer full whatever they say
    (as transformers forces it)."""
    if cfg.get("layer_types") is not None:
        kinds = layer_types_kinds(cfg, num_layers)
    else:
        kinds = list(pattern_layer_types(num_layers, 6))
    return [*kinds[:-1], FULL]


def _kv_shape(cfg: Mapping[str, Any], kind: str) -> tuple[int, int]:
    """Sliding layers: ``num_key_value_heads`` of ``head_dim``. Full layers: what
    ``per_layer_config`` says for them, else ``global_head_dim`` (512) and, with
    ``attention_k_eq_v``, ``num_global_key_value_heads``."""
    heads, dim = int_field(cfg, "num_key_value_heads"), int_field(cfg, "head_dim")
    per_layer = cfg.get("per_layer_config")
    if isinstance(per_layer, Mapping):
        kinds = _kinds(cfg, int_field(cfg, "num_hidden_layers"))
        shapes = set()
        for index, fields in per_layer.items():
            unknown = sorted(set(fields) - {"head_dim", "num_key_value_heads"})
            if unknown:
                raise ModelConfigError(f"per_layer_config sets {unknown}, which are not read")
            if kinds[int(index)] == kind:
                shapes.add((fields.get("num_key_value_heads", heads), fields.get("head_dim", dim)))
        if len(shapes) > 1:
            raise ModelConfigError(f"per_layer_config gives {kind} layers differing shapes")
        return shapes.pop() if shapes else (heads, dim)
    if kind != FULL:
        return heads, dim
    if flag_field(cfg, "attention_k_eq_v", False):
        heads = int_field(cfg, "num_global_key_value_heads", heads)
    return heads, int_field(cfg, "global_head_dim", 512)


def _shared_kv(cfg: Mapping[str, Any], kinds: list[str]) -> dict[int, int]:
    """Each of the last ``num_kv_shared_layers`` layers -> the last earlier layer of its
    kind that keeps its own cache."""
    shared = cfg.get("num_kv_shared_layers") or 0
    if not isinstance(shared, int) or not 0 <= shared <= len(kinds):
        raise ModelConfigError(
            f"config field 'num_kv_shared_layers' must be an integer from 0 to the layers' "
            f"{len(kinds)}, got {shared!r}"
        )
    first = len(kinds) - shared
    owners: dict[int, int] = {}
    for reader in range(first, len(kinds)):
        earlier = [i for i in range(first) if kinds[i] == kinds[reader]]
        if not earlier:
            raise ModelConfigError(
                f"num_kv_shared_layers={shared}: layer {reader} ({kinds[reader]}) has no "
                "earlier layer of its kind whose cache it could read"
            )
        owners[reader] = earlier[-1]
    return owners


FAMILY = Family(
    model_types=("gemma4_text",),
    layer_kinds=_kinds,
    parse=parse_gemma4,
    decoder=attrs.evolve(SANDWICH, mlp="dense_and_experts"),
    renames={
        f"model.{name}.weight": f"model.per_layer_inputs.{name}.weight" for name in _PER_LAYER
    },
    kv_shape=_kv_shape,
    shared_kv=_shared_kv,
    # The multimodal config (its text model nested in ``text_config``) is sized, not run.
    sized_types=("gemma4",),
)
