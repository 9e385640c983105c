"""gpt-oss: sliding (128) and full layers alternating, a learned attention sink per head,
biases on q/k/v and the output, YaRN rope, and a mixture of experts in every layer with
biased experts and router and gpt-oss's clamped SwiGLU (``models/shapes/moe.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.hf_config import flag_field, float_field, int_field
from hybridkv.models.kinds import FULL, SLIDING, PolicyChoices, kinds_by, pattern_layer_types
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.moe import ExpertsShape
from hybridkv.models.shapes.rope import rope_from_hf

#: The rope of a config that names none (transformers' default for gpt-oss).
_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def parse_gpt_oss(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a gpt-oss config.json."""
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    if not (hf.get("rope_parameters") or hf.get("rope_scaling")):
        hf = {**hf, "rope_parameters": _ROPE}
    rope = rope_from_hf(hf, default_theta=150_000.0)
    return ModelConfig(
        **{
            **fields,
            "attention_bias": flag_field(hf, "attention_bias", True),
            "rms_norm_eps": float_field(hf, "rms_norm_eps", 1e-5),
            "rope": {FULL: rope, SLIDING: rope},
        },
        norm_scale_first=True,
        attention_sinks=frozenset({FULL, SLIDING}),
        experts=ExpertsShape(
            num_experts=int_field(hf, "num_local_experts"),
            top_k=int_field(hf, "num_experts_per_tok", 4),
            inner=fields["intermediate_size"],
            bias=True,
            activation="clamped",
            alpha=float_field(hf, "swiglu_alpha", 1.702),
            limit=float_field(hf, "swiglu_limit", 7.0),
        ),
    )


FAMILY = Family(
    model_types=("gpt_oss",),
    # Without layer_types: even layers slide, odd ones are full.
    layer_kinds=kinds_by(lambda cfg, n: list(pattern_layer_types(n, 2))),
    parse=parse_gpt_oss,
    decoder=DecoderShape(mlp="experts"),
)
