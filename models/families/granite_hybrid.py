"""Granite 4.0-H (``granitemoehybrid``): Bamba's hybrid layers with Granite's scalings.

``h = x + m * mixer(norm(x)); out = h + m * (shared_mlp(norm(h)) [+ moe(norm(h))])`` with
``m`` the ``residual_multiplier``; embeddings are scaled by ``embedding_multiplier``,
attention scores by ``attention_multiplier``, logits divided by ``logits_scaling``.
Attention layers use rope only when ``position_embedding_type`` is ``rope``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import FULL, ModelConfig, activation_of
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.families import Family
from hybridkv.models.families.common import common_fields
from hybridkv.models.hf_config import float_field, int_field, text_config
from hybridkv.models.kinds import MAMBA, PolicyChoices, kinds_by
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.mamba2 import mamba2_shape
from hybridkv.models.shapes.moe import ExpertsShape
from hybridkv.models.shapes.rope import RopeSpec, rope_from_hf


def granite_scalings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Granite's four multipliers as ``ModelConfig`` fields (Granite 4.0-H, Granite SWA):
    embeddings, attention scores, residual branches, and the logits' divisor."""
    return {
        "embed_scale": float_field(cfg, "embedding_multiplier", 1.0),
        "query_scale": float_field(cfg, "attention_multiplier", 1.0),
        "residual_multiplier": float_field(cfg, "residual_multiplier", 1.0),
        "logits_scaling": float_field(cfg, "logits_scaling", 1.0),
    }


def parse_granite_hybrid(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a ``granitemoehybrid`` config.json (dense or with MoE layers)."""
    cfg = text_config(hf)
    fields = common_fields(cfg, dtype_bytes=dtype_bytes, policies=policies)
    activation = activation_of(str(cfg.get("hidden_act", "silu")))
    if activation != "silu":
        raise ModelConfigError(f"config field 'hidden_act' must be silu, got {activation!r}")
    num_experts = int(cfg.get("num_local_experts") or 0)
    position = cfg.get("position_embedding_type")
    if position == "rope":
        rope = rope_from_hf(cfg, default_theta=10_000.0)
    elif position in (None, "nope"):
        rope = RopeSpec(theta=10_000.0, partial_rotary_factor=0.0)
    else:
        raise ModelConfigError(
            f"config field 'position_embedding_type' must be rope, nope or null, got {position!r}"
        )
    return ModelConfig(
        **{**fields, "intermediate_size": int_field(cfg, "shared_intermediate_size", 1024)},
        **granite_scalings(cfg),
        norm_offset=0.0,
        activation=activation,
        qk_norm=False,
        attn_softcap=None,
        final_softcap=None,
        rope={FULL: rope},
        mlp_bias=False,
        mamba=mamba2_shape(cfg),
        experts=ExpertsShape(
            num_experts=num_experts,
            top_k=int_field(cfg, "num_experts_per_tok", 2),
            inner=fields["intermediate_size"],
        )
        if num_experts
        else None,
    )


#: Granite 4.0-H ``layer_types`` names, by kind (transformers writes the second of each).
_KINDS = {"attention": FULL, "full_attention": FULL, "mamba": MAMBA, "linear_attention": MAMBA}

FAMILY = Family(
    model_types=("granitemoehybrid",),
    layer_kinds=kinds_by(lambda cfg, n: [MAMBA] * n, _KINDS),
    parse=parse_granite_hybrid,
    decoder=DecoderShape(mlp="shared_and_experts"),
    state_shape=mamba2_shape,
)
