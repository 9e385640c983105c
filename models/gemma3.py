"""Gemma 3 (text): Gemma 2's blocks plus q/k norms, 5 sliding : 1 full, rope per layer type.

Sliding layers rotate with the local base frequency (``rope_local_base_freq``, 10k), full
layers with ``rope_theta`` (1M) and its scaling (linear x8 on the larger models).
Attention scores are not soft-capped: the reference ignores ``attn_logit_softcapping``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import FULL, SLIDING, ModelConfig, common_fields
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.gemma2 import (
    GemmaDecoderLayer,
    gemma_activation,
    gemma_layer_types,
    optional_float,
)
from hybridkv.models.rope import RopeSpec
from hybridkv.models.transformer import Architecture


def gemma3_rope(hf: Mapping[str, Any]) -> dict[str, RopeSpec]:
    """Rope specs per layer type from ``rope_parameters`` (nested) or the legacy fields."""
    max_positions = int(hf.get("max_position_embeddings") or 131_072)
    global_theta = float(hf.get("rope_theta") or 1_000_000.0)
    local_theta = float(hf.get("rope_local_base_freq") or 10_000.0)
    params = hf.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full, sliding = params.get(FULL), params.get(SLIDING)
    else:
        full, sliding = params or hf.get("rope_scaling"), None
    return {
        FULL: RopeSpec.from_hf(full, theta=global_theta, max_positions=max_positions),
        SLIDING: RopeSpec.from_hf(sliding, theta=local_theta, max_positions=max_positions),
    }


def parse_gemma3(hf: Mapping[str, Any]) -> ModelConfig:
    """Read a Gemma 3 text config.json (``gemma3_text``)."""
    if hf.get("use_bidirectional_attention"):
        raise ModelConfigError("use_bidirectional_attention=true is not supported (causal only)")
    fields = common_fields(hf)
    fields["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    return ModelConfig(
        **fields,
        norm_offset=1.0,
        activation=gemma_activation(hf),
        qk_norm=True,
        embed_scale=math.sqrt(fields["hidden_size"]),
        query_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_softcap=None,
        final_softcap=optional_float(hf.get("final_logit_softcapping")),
        layer_types=gemma_layer_types(hf, every=6),
        sliding_window=int(hf.get("sliding_window") or 4096),
        rope=gemma3_rope(hf),
        mlp_bias=False,
    )


GEMMA3 = Architecture(model_types=("gemma3_text",), parse=parse_gemma3, layer=GemmaDecoderLayer)
