"""Gemma 3 (text): Gemma 2's blocks plus q/k norms, 5 sliding : 1 full, rope per layer type.

Sliding layers rotate with the local base frequency (``rope_local_base_freq``, 10k), full
layers with ``rope_theta`` (1M) and its scaling (linear x8 on the larger models).
Attention scores are not soft-capped: the reference ignores ``attn_logit_softcapping``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import FULL, SLIDING, ModelConfig
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.gemma2 import GemmaDecoderLayer, gemma_fields
from hybridkv.models.hf_config import optional_float_field
from hybridkv.models.rope import RopeSpec
from hybridkv.models.specs import PolicyChoices
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


def parse_gemma3(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Gemma 3 text config.json (``gemma3_text``).

    ``dtype_bytes`` and ``policies`` shape the layer specs (see ``common_fields``).
    """
    if hf.get("use_bidirectional_attention"):
        raise ModelConfigError("use_bidirectional_attention=true is not supported (causal only)")
    return ModelConfig(
        **gemma_fields(hf, dtype_bytes=dtype_bytes, policies=policies),
        qk_norm=True,
        attn_softcap=None,
        final_softcap=optional_float_field(hf, "final_logit_softcapping", None),
        rope=gemma3_rope(hf),
    )


GEMMA3 = Architecture(model_types=("gemma3_text",), parse=parse_gemma3, layer=GemmaDecoderLayer)
