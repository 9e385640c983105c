"""LFM3: LFM2's short convolutions beside sliding-window and full attention (three memory
kinds), a sigmoid gate per attention head on its output (``g_proj``), sandwich norms
(``post_operator_norm``, ``post_ffn_norm``), a rope per attention kind (the full layers'
proportional, over half of each head), and an MLP of ``intermediate_size``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.families import Family
from hybridkv.models.families.lfm2 import LFM2_PARTS
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.hf_config import flag_field, float_field
from hybridkv.models.kinds import FULL, SHORT_CONV, SLIDING, PolicyChoices, kinds_by
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.short_conv import short_conv_shape


def parse_lfm3(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read an LFM3 config.json."""
    if not flag_field(hf, "use_sandwich_norm", True):
        raise ModelConfigError(
            "LFM3 without sandwich norms (use_sandwich_norm: false) is not supported: every "
            "released LFM3 normalises each sublayer's output"
        )
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    gated = flag_field(hf, "use_attention_gate", True)
    return ModelConfig(
        **{**fields, "qk_norm": True, "rms_norm_eps": float_field(hf, "norm_eps", 1e-5)},
        short_conv=short_conv_shape(hf),
        attention_output_gate="head" if gated else "none",
    )


def _pattern(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """transformers' default: full attention at layer 2 of every 4, sliding at the other
    multiples of 4 but the first layer, short convolutions elsewhere."""
    return [
        FULL if i % 4 == 2 else SLIDING if i % 4 == 0 and i > 0 else SHORT_CONV
        for i in range(num_layers)
    ]


FAMILY = Family(
    model_types=("lfm3",),
    layer_kinds=kinds_by(
        _pattern, {"full_attention": FULL, "sliding_attention": SLIDING, "conv": SHORT_CONV}
    ),
    parse=parse_lfm3,
    decoder=DecoderShape(
        residual="sandwich",
        mixer_norm="operator_norm",
        post_mixer_norm="post_operator_norm",
        mlp_norm="ffn_norm",
        post_mlp_norm="post_ffn_norm",
        mlp_name="feed_forward",
    ),
    renames={"model.embedding_norm.weight": "model.norm.weight"},
    part_renames={**LFM2_PARTS, ".self_attn.g_proj.": ".self_attn.gate_proj."},
    state_shape=short_conv_shape,
)
