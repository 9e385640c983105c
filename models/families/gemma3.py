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
from hybridkv.models.families import Family
from hybridkv.models.families.gemma2 import gemma_fields
from hybridkv.models.hf_config import int_field, optional_float_field
from hybridkv.models.kinds import PolicyChoices, kinds_by, pattern_layer_types
from hybridkv.models.shapes.decoder import SANDWICH
from hybridkv.models.shapes.rope import RopeSpec


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


def _pattern(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """Every ``sliding_window_pattern``-th layer full, the rest sliding. transformers reads
    ``sliding_window_pattern`` and writes it under both names; a file holding only the
    private name still means its own pattern, not the default (6)."""
    if cfg.get("sliding_window_pattern") is not None:
        every = int_field(cfg, "sliding_window_pattern")
    else:
        every = int_field(cfg, "_sliding_window_pattern", 6)
    return list(pattern_layer_types(num_layers, every))


FAMILY = Family(
    model_types=("gemma3_text",),
    layer_kinds=kinds_by(_pattern),
    parse=parse_gemma3,
    decoder=SANDWICH,
    # The multimodal config (its text model nested in ``text_config``) is sized, not run.
    sized_types=("gemma3",),
)
