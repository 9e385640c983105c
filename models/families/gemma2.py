"""Gemma 2: sandwich norms, GELU-tanh, alternating sliding and full layers, soft-capping."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig, activation_of
from hybridkv.models.families import Family
from hybridkv.models.families.common import common_fields
from hybridkv.models.hf_config import flag_field, float_field, optional_float_field
from hybridkv.models.kinds import FULL, SLIDING, PolicyChoices, kinds_by, pattern_layer_types
from hybridkv.models.shapes.decoder import SANDWICH
from hybridkv.models.shapes.rope import rope_from_hf


def gemma_activation(hf: Mapping[str, Any]) -> str:
    """Gemma configs name the activation ``hidden_activation`` (older ones ``hidden_act``)."""
    return activation_of(str(hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_tanh"))


def gemma_fields(
    hf: Mapping[str, Any], *, dtype_bytes: int, policies: PolicyChoices | None
) -> dict[str, Any]:
    """What Gemma 2 and Gemma 3 read alike: common fields, Gemma norms, scales, activation."""
    fields = common_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    return {
        **fields,
        "tie_word_embeddings": flag_field(hf, "tie_word_embeddings", True),
        "norm_offset": 1.0,
        "activation": gemma_activation(hf),
        "embed_scale": math.sqrt(fields["hidden_size"]),
        "query_scale": float_field(hf, "query_pre_attn_scalar", 256) ** -0.5,
        "mlp_bias": False,
    }


def parse_gemma2(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Gemma 2 config.json; defaults are those of the released models.

    ``dtype_bytes`` and ``policies`` shape the layer specs (see ``common_fields``).
    """
    rope = rope_from_hf(hf, default_theta=10_000.0)
    return ModelConfig(
        **gemma_fields(hf, dtype_bytes=dtype_bytes, policies=policies),
        qk_norm=False,
        attn_softcap=optional_float_field(hf, "attn_logit_softcapping", 50.0),
        final_softcap=optional_float_field(hf, "final_logit_softcapping", 30.0),
        rope={FULL: rope, SLIDING: rope},
    )


FAMILY = Family(
    model_types=("gemma2",),
    # Even layers (0, 2, ...) slide, odd ones are full.
    layer_kinds=kinds_by(lambda cfg, n: list(pattern_layer_types(n, 2))),
    parse=parse_gemma2,
    decoder=SANDWICH,
)
