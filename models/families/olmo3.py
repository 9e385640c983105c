"""OLMo 3: Llama's projections in post-norm layers (each sublayer's output normalised, not
its input), q and k each normalised over the whole projection (every head together), 3
sliding layers to 1 full, a rope spec per layer kind. Its RMSNorm scales in float32
before casting back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.kinds import PolicyChoices, kinds_by, pattern_layer_types
from hybridkv.models.shapes.decoder import POST_NORM


def parse_olmo3(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read an OLMo 3 config.json."""
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    return ModelConfig(
        **{**fields, "qk_norm": True}, qk_norm_width="projection", norm_scale_first=True
    )


FAMILY = Family(
    model_types=("olmo3",),
    # Without layer_types: every fourth layer full, the others sliding.
    layer_kinds=kinds_by(lambda cfg, n: list(pattern_layer_types(n, 4))),
    parse=parse_olmo3,
    decoder=POST_NORM,
)
