"""Granite 4.0-H (``granitemoehybrid``): Bamba's hybrid layers with Granite's scalings.

``h = x + m * mixer(norm(x)); out = h + m * (shared_mlp(norm(h)) [+ moe(norm(h))])`` with
``m`` the ``residual_multiplier``; embeddings are scaled by ``embedding_multiplier``,
attention scores by ``attention_multiplier``, logits divided by ``logits_scaling``.
Attention layers use rope only when ``position_embedding_type`` is ``rope``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybridkv.models.bamba import Mixers
from hybridkv.models.config import FULL, ModelConfig, activation_of, common_fields
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.hf_config import float_field, int_field, text_config
from hybridkv.models.layers import LayerInputs, RMSNorm
from hybridkv.models.moe import MixtureOfExperts, SharedMLP
from hybridkv.models.rope import RopeSpec, rope_from_hf
from hybridkv.models.specs import PolicyChoices
from hybridkv.models.state_shapes import mamba2_shape
from hybridkv.models.transformer import Architecture


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
        norm_offset=0.0,
        activation=activation,
        qk_norm=False,
        embed_scale=float_field(cfg, "embedding_multiplier", 1.0),
        query_scale=float_field(cfg, "attention_multiplier", 1.0),
        attn_softcap=None,
        final_softcap=None,
        rope={FULL: rope},
        mlp_bias=False,
        mamba=mamba2_shape(cfg),
        residual_multiplier=float_field(cfg, "residual_multiplier", 1.0),
        logits_scaling=float_field(cfg, "logits_scaling", 1.0),
        num_experts=num_experts,
        num_experts_per_token=int_field(cfg, "num_experts_per_tok", 2) if num_experts else 0,
        expert_intermediate_size=fields["intermediate_size"] if num_experts else 0,
    )


class GraniteHybridDecoderLayer(Mixers):
    """Pre-norm mixer, then the shared MLP (and the experts, when the model has them),
    each branch scaled by the residual multiplier."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, config.norm_offset)
        self.post_attention_layernorm = RMSNorm(hidden, eps, config.norm_offset)
        self.shared_mlp = SharedMLP(hidden, config.intermediate_size)
        self.block_sparse_moe = (
            MixtureOfExperts(
                hidden,
                config.expert_intermediate_size,
                config.num_experts,
                config.num_experts_per_token,
            )
            if config.num_experts
            else None
        )
        self.residual_multiplier = config.residual_multiplier

    def forward(self, hidden: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        scale = self.residual_multiplier
        hidden = hidden + self.mix(self.input_layernorm(hidden), inputs) * scale
        normed = self.post_attention_layernorm(hidden)
        out: torch.Tensor = self.shared_mlp(normed)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(normed) + out
        return hidden + out * scale


GRANITE_HYBRID = Architecture(
    model_types=("granitemoehybrid",),
    parse=parse_granite_hybrid,
    layer=GraniteHybridDecoderLayer,
)
