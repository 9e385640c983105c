"""Bamba: Mamba2 layers with a few full-attention layers between, a SwiGLU MLP in each.

``h = x + mixer(norm(x)); out = h + mlp(norm(h))``, the mixer being Mamba2 (its state in
pages of the pool, ``hybridkv.models.blocks.mamba2``) or paged attention with rope on the
first half of each head (``partial_rotary_factor`` 0.5 in the config).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import FULL, ModelConfig, activation_of
from hybridkv.models.families import Family
from hybridkv.models.families.common import common_fields
from hybridkv.models.hf_config import flag_field, text_config
from hybridkv.models.kinds import MAMBA, PolicyChoices
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.mamba2 import mamba2_shape
from hybridkv.models.shapes.rope import rope_from_hf


def parse_bamba(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Bamba config.json (layer kinds from ``attn_layer_indices``)."""
    fields = common_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    cfg = text_config(hf)
    num_heads = fields["num_heads"]
    return ModelConfig(
        **fields,
        norm_offset=0.0,
        activation=activation_of(str(cfg.get("hidden_act", "silu"))),
        qk_norm=False,
        embed_scale=None,
        query_scale=(fields["hidden_size"] // num_heads) ** -0.5,
        attn_softcap=None,
        final_softcap=None,
        rope={FULL: rope_from_hf(cfg, default_theta=10_000.0)},
        mlp_bias=flag_field(cfg, "mlp_bias", False),
        mamba=mamba2_shape(cfg),
    )


def _kinds(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """Full attention in the layers of ``attn_layer_indices``, Mamba2 in the others."""
    attention = set(cfg.get("attn_layer_indices") or ())
    return [FULL if i in attention else MAMBA for i in range(num_layers)]


FAMILY = Family(
    model_types=("bamba",),
    layer_kinds=_kinds,
    parse=parse_bamba,
    decoder=DecoderShape(mlp_norm="pre_ff_layernorm", mlp_name="feed_forward"),
    renames={"model.final_layernorm.weight": "model.norm.weight"},
    state_shape=mamba2_shape,
)
