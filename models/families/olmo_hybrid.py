"""OLMo Hybrid: Gated DeltaNet layers (pre-norm, their own q/k/v/a/b/g projections, write
rates up to 2: ``linear_allow_neg_eigval``) with a full attention layer every fourth
(post-norm as OLMo 3's, q and k normalised over the whole projection; without rope in the
released checkpoints, whose ``rope_theta`` is null)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hybridkv.models.config import ModelConfig
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.hf_config import flag_field
from hybridkv.models.kinds import DELTANET, FULL, PolicyChoices, kinds_by
from hybridkv.models.shapes.decoder import POST_NORM, PRE_NORM
from hybridkv.models.shapes.deltanet import DeltaNetShape, deltanet_shape


def parse_olmo_hybrid(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read an OLMo Hybrid config.json."""
    rotates = (hf.get("rope_parameters") or {}).get("rope_theta") is not None
    if not rotates:  # as released: ``rope_theta`` null, no rope in any layer
        hf = {**hf, "rope_parameters": None}
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    layers = fields["layers"]
    nope = frozenset() if rotates else frozenset(range(len(layers)))
    return ModelConfig(
        **{**fields, "qk_norm": True},
        qk_norm_width="projection",
        norm_scale_first=True,
        nope_layers=nope,
        deltanet=_shape(hf),
    )


def _shape(cfg: Mapping[str, Any]) -> DeltaNetShape:
    """The DeltaNet's shape: rates doubled where ``linear_allow_neg_eigval`` (the default),
    its output norm's epsilon FLA's 1e-5."""
    rate = 2.0 if flag_field(cfg, "linear_allow_neg_eigval", True) else 1.0
    return attrs.evolve(deltanet_shape(cfg), rate_scale=rate, norm_eps=1e-5)


def _pattern(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """Every fourth layer full attention (the last where none would be), the rest DeltaNet."""
    kinds = [FULL if i % 4 == 3 else DELTANET for i in range(num_layers)]
    return kinds if FULL in kinds else [*kinds[:-1], FULL]


FAMILY = Family(
    model_types=("olmo_hybrid",),
    layer_kinds=kinds_by(_pattern, {"full_attention": FULL, "linear_attention": DELTANET}),
    parse=parse_olmo_hybrid,
    decoder=POST_NORM,
    decoders={DELTANET: PRE_NORM},
    part_renames={
        ".attention_layer_norm.": ".input_layernorm.",
        ".feedforward_layer_norm.": ".post_attention_layernorm.",
    },
    state_shape=_shape,
)
