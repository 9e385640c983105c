"""Bamba: Mamba2 layers with a few full-attention layers between, a SwiGLU MLP in each.

``h = x + mixer(norm(x)); out = h + mlp(norm(h))``, the mixer being Mamba2 (its state in
pages of the pool, ``hybridkv.models.mamba2``) or paged attention with rope on the first
half of each head (``partial_rotary_factor`` 0.5 in the config).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.memory.layout import StateSpec
from hybridkv.models.config import FULL, ModelConfig, activation_of, common_fields
from hybridkv.models.hf_config import flag_field, text_config
from hybridkv.models.layers import GatedMLP, LayerInputs, PagedAttention, RMSNorm
from hybridkv.models.mamba2 import Mamba2Mixer
from hybridkv.models.rope import rope_from_hf
from hybridkv.models.specs import PolicyChoices
from hybridkv.models.state_shapes import mamba2_shape
from hybridkv.models.transformer import Architecture


def parse_bamba(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Bamba config.json (layer kinds from ``attn_layer_indices``)."""
    fields = common_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    cfg = text_config(hf)
    num_heads = fields["num_heads"]
    return ModelConfig(
        **fields,
        norm_offset=0.0,
        activation=activation_of(str(cfg.get("hidden_act", "silu"))),
        qk_norm=False,
        embed_scale=None,
        query_scale=(fields["hidden_size"] // num_heads) ** -0.5,
        attn_softcap=None,
        final_softcap=None,
        rope={FULL: rope_from_hf(cfg, default_theta=10_000.0)},
        mlp_bias=flag_field(cfg, "mlp_bias", False),
        mamba=mamba2_shape(cfg),
    )


class Mixers(nn.Module):
    """A hybrid layer's token mixer under its checkpoint name: ``mamba`` for a state layer
    (Mamba2), ``self_attn`` for an attention layer; the other is None."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        is_state = isinstance(config.layers[layer], StateSpec)
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: PagedAttention | None = None
        if is_state:
            assert config.mamba is not None, "a state layer without a Mamba2 shape"
            self.mamba = Mamba2Mixer(config.mamba, config.rms_norm_eps)
        else:
            self.self_attn = PagedAttention(config, layer)

    def mix(self, hidden: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        """Run whichever mixer the layer has."""
        if self.mamba is not None:
            return self.mamba(hidden, inputs)  # type: ignore[no-any-return]
        assert self.self_attn is not None
        return self.self_attn(hidden, inputs)  # type: ignore[no-any-return]


class BambaDecoderLayer(Mixers):
    """Pre-norm mixer (Mamba2 or attention), then the pre-norm gated MLP."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, config.norm_offset)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps, config.norm_offset)
        self.feed_forward = GatedMLP(config, bias=config.mlp_bias)

    def forward(self, hidden: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        hidden = hidden + self.mix(self.input_layernorm(hidden), inputs)
        mlp: torch.Tensor = self.feed_forward(self.pre_ff_layernorm(hidden))
        return hidden + mlp


BAMBA = Architecture(
    model_types=("bamba",),
    parse=parse_bamba,
    layer=BambaDecoderLayer,
    renames={"model.final_layernorm.weight": "model.norm.weight"},
)
