"""LFM2: short-convolution layers (``conv``: a state per request) beside full attention
layers (``full_attn_idxs``), pre-norm (``operator_norm``, ``ffn_norm``), q/k norms per head,
a SwiGLU MLP whose width transformers derives from ``intermediate_size``
(``block_auto_adjust_ff_dim``), the final norm named ``embedding_norm``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.hf_config import flag_field, float_field, int_field
from hybridkv.models.kinds import FULL, SHORT_CONV, PolicyChoices, kinds_by
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.short_conv import short_conv_shape, short_conv_state_bytes


def parse_lfm2(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read an LFM2 config.json."""
    if hf.get("tie_word_embeddings") is None:  # older configs name it ``tie_embedding``
        hf = {**hf, "tie_word_embeddings": flag_field(hf, "tie_embedding", True)}
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    return ModelConfig(
        **{
            **fields,
            "qk_norm": True,
            "rms_norm_eps": float_field(hf, "norm_eps", 1e-5),
            "intermediate_size": _mlp_width(hf),
        },
        short_conv=short_conv_shape(hf),
    )


def _mlp_width(hf: Mapping[str, Any]) -> int:
    """The MLP's width as transformers derives it: 2/3 of ``intermediate_size`` (or
    ``block_ff_dim``), times ``block_ffn_dim_multiplier``, up to ``block_multiple_of``."""
    width = int_field(hf, "block_ff_dim" if hf.get("block_ff_dim") else "intermediate_size")
    if not flag_field(hf, "block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is None:
        return width
    multiple = int_field(hf, "block_multiple_of", 256)
    width = int(float(multiplier) * width)
    return multiple * ((width + multiple - 1) // multiple)


def _pattern(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """Full attention at ``full_attn_idxs`` (every layer without them), conv elsewhere."""
    full = cfg.get("full_attn_idxs")
    attention = set(range(num_layers)) if full is None else {int(i) for i in full}
    return [FULL if i in attention else SHORT_CONV for i in range(num_layers)]


FAMILY = Family(
    model_types=("lfm2",),
    layer_kinds=kinds_by(_pattern, {"full_attention": FULL, "conv": SHORT_CONV}),
    parse=parse_lfm2,
    decoder=DecoderShape(mixer_norm="operator_norm", mlp_norm="ffn_norm", mlp_name="feed_forward"),
    renames={"model.embedding_norm.weight": "model.norm.weight"},
    part_renames={
        ".feed_forward.w1.": ".feed_forward.gate_proj.",
        ".feed_forward.w3.": ".feed_forward.up_proj.",
        ".feed_forward.w2.": ".feed_forward.down_proj.",
        ".self_attn.out_proj.": ".self_attn.o_proj.",
        ".self_attn.q_layernorm.": ".self_attn.q_norm.",
        ".self_attn.k_layernorm.": ".self_attn.k_norm.",
    },
    state_bytes=short_conv_state_bytes,
    state_shape=short_conv_shape,
)
