"""Command R7B and Command A (Cohere 2): one LayerNorm (no bias) before attention and the
MLP side by side, rope on adjacent channel pairs and only in the sliding layers (3 to 1
full, the full ones without rope), logits multiplied by ``logit_scale``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.hf_config import flag_field, float_field
from hybridkv.models.kinds import FULL, PolicyChoices, kinds_by, pattern_layer_types
from hybridkv.models.shapes.decoder import PARALLEL


def parse_cohere2(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Cohere 2 config.json."""
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    kinds = [spec.kind for spec in fields["layers"]]
    return ModelConfig(
        **{
            **fields,
            "rms_norm_eps": float_field(hf, "layer_norm_eps", 1e-5),
            "tie_word_embeddings": flag_field(hf, "tie_word_embeddings", True),
        },
        norm_kind="layer",
        rope_interleaved=True,
        nope_layers=frozenset(i for i, kind in enumerate(kinds) if kind == FULL),
        logits_scaling=1.0 / float_field(hf, "logit_scale", 0.0625),
    )


FAMILY = Family(
    model_types=("cohere2",),
    # Without layer_types: every fourth layer full (sliding_window_pattern, 4).
    layer_kinds=kinds_by(lambda cfg, n: list(pattern_layer_types(n, 4))),
    parse=parse_cohere2,
    decoder=PARALLEL,
)
