"""Gemma 2: sandwich norms, GELU-tanh, alternating sliding/full layers, soft-capping."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.config import ModelConfig, activation_of, common_fields
from hybridkv.models.layers import GatedMLP, LayerInputs, PagedAttention, RMSNorm
from hybridkv.models.rope import rope_from_hf
from hybridkv.models.specs import FULL, SLIDING, pattern_layer_types
from hybridkv.models.transformer import Architecture


def gemma_activation(hf: Mapping[str, Any]) -> str:
    """Gemma configs name the activation ``hidden_activation`` (older ones ``hidden_act``)."""
    return activation_of(str(hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_tanh"))


def gemma_layer_types(hf: Mapping[str, Any], every: int) -> tuple[str, ...]:
    """``layer_types`` if given, else every ``every``-th layer full, the others sliding."""
    given = hf.get("layer_types")
    if given:
        return tuple(str(t) for t in given)
    every = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or every)
    return pattern_layer_types(int(hf["num_hidden_layers"]), every)


def optional_float(value: object) -> float | None:
    """A config number that may be null."""
    return None if value is None else float(value)  # type: ignore[arg-type]


def parse_gemma2(hf: Mapping[str, Any]) -> ModelConfig:
    """Read a Gemma 2 config.json; defaults are those of the released models."""
    fields = common_fields(hf)
    fields["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    rope = rope_from_hf(hf, default_theta=10_000.0)
    return ModelConfig(
        **fields,
        norm_offset=1.0,
        activation=gemma_activation(hf),
        qk_norm=False,
        embed_scale=math.sqrt(fields["hidden_size"]),
        query_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_softcap=optional_float(hf.get("attn_logit_softcapping", 50.0)),
        final_softcap=optional_float(hf.get("final_logit_softcapping", 30.0)),
        layer_types=gemma_layer_types(hf, every=2),
        sliding_window=int(hf.get("sliding_window") or 4096),
        rope={FULL: rope, SLIDING: rope},
        mlp_bias=False,
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
        return hidden + self.post_feedforward_layernorm(mlp)


GEMMA2 = Architecture(model_types=("gemma2",), parse=parse_gemma2, layer=GemmaDecoderLayer)
