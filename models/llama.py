"""Llama: pre-norm blocks, SiLU MLP, full attention in every layer, one rope table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.models.config import FULL, ModelConfig, activation_of, common_fields
from hybridkv.models.hf_config import flag_field
from hybridkv.models.layers import GatedMLP, LayerInputs, PagedAttention, RMSNorm
from hybridkv.models.rope import rope_from_hf
from hybridkv.models.specs import PolicyChoices
from hybridkv.models.transformer import Architecture


def parse_llama(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Llama config.json: plain RMSNorm weights, ``head_dim ** -0.5`` scaling.

    ``dtype_bytes`` and ``policies`` shape the layer specs (see :func:`common_fields`).
    """
    fields = common_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    return ModelConfig(
        **fields,
        norm_offset=0.0,
        activation=activation_of(str(hf.get("hidden_act", "silu"))),
        qk_norm=False,
        embed_scale=None,
        query_scale=fields["layers"][0].head_dim ** -0.5,
        attn_softcap=None,
        final_softcap=None,
        rope={FULL: rope_from_hf(hf, default_theta=10_000.0)},
        mlp_bias=flag_field(hf, "mlp_bias", False),
    )


class LlamaDecoderLayer(nn.Module):
    """``h = x + attn(norm(x)); out = h + mlp(norm(h))``.

    The checkpoint calls the norm before the MLP ``post_attention_layernorm``.
    """

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, config.norm_offset)
        self.self_attn = PagedAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, config.norm_offset)
        self.mlp = GatedMLP(config, bias=config.mlp_bias)

    def forward(self, hidden: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), inputs)
        mlp: torch.Tensor = self.mlp(self.post_attention_layernorm(hidden))
        return hidden + mlp


LLAMA = Architecture(model_types=("llama",), parse=parse_llama, layer=LlamaDecoderLayer)
