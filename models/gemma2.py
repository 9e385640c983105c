"""Gemma 2: sandwich norms, GELU-tanh, alternating sliding/full layers, soft-capping."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.config import ModelConfig, activation_of, common_fields
from hybridkv.models.hf_config import flag_field, float_field, optional_float_field
from hybridkv.models.layers import GatedMLP, LayerInputs, PagedAttention, RMSNorm
from hybridkv.models.rope import rope_from_hf
from hybridkv.models.specs import FULL, SLIDING, PolicyChoices
from hybridkv.models.transformer import Architecture


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


class GemmaDecoderLayer(nn.Module):
    """Sandwich norms: each sublayer's input and output are normalised.

    ``h = x + post_attn(attn(pre_attn(x))); out = h + post_ff(mlp(pre_ff(h)))``.
    """

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        size, eps, offset = config.hidden_size, config.rms_norm_eps, config.norm_offset
        self.input_layernorm = RMSNorm(size, eps, offset)
        self.self_attn = PagedAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(size, eps, offset)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, offset)
        self.mlp = GatedMLP(config, bias=False)
        self.post_feedforward_layernorm = RMSNorm(size, eps, offset)

    def forward(self, hidden: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), inputs)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        normed: torch.Tensor = self.post_feedforward_layernorm(mlp)
        return hidden + normed


GEMMA2 = Architecture(model_types=("gemma2",), parse=parse_gemma2, layer=GemmaDecoderLayer)
