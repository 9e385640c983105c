"""Gemma 4's per-layer inputs (PLE): a vector per token for every layer, from a packed
embedding of the token and a projection of its embedding (``models/shapes/decoder.py``
has the shape; ``blocks/decoder.py`` adds each layer's vector to its output).

Gemma 4 checkpoints name the parts on the backbone (``model.embed_tokens_per_layer``,
``model.per_layer_model_projection``, ``model.per_layer_projection_norm``); the family
renames them into this block, ``model.per_layer_inputs``.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.blocks.norms import config_rms_norm
from hybridkv.models.config import ModelConfig


class PerLayerEmbedding(nn.Module):
    """Token ids and their embeddings in, ``[num_tokens, num_layers, width]`` out:
    ``(norm(projection(embeds) / sqrt(hidden)) + table[ids] * sqrt(width)) / sqrt(2)``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        shape = config.per_layer_inputs
        assert shape is not None, "a model without per-layer inputs"
        self.num_layers, self.width = config.num_layers, shape.width
        packed = config.num_layers * shape.width
        self.embed_tokens_per_layer = nn.Embedding(shape.vocab_size, packed)
        self.per_layer_model_projection = nn.Linear(config.hidden_size, packed, bias=False)
        self.per_layer_projection_norm = config_rms_norm(config, shape.width)
        self.projection_scale = config.hidden_size**-0.5

    def forward(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        rows = (input_ids.shape[0], self.num_layers, self.width)
        table: torch.Tensor = self.embed_tokens_per_layer(input_ids)
        # Scaled in the model dtype, as the reference does (bf16 rounds the factor).
        table = table * torch.tensor(self.width**0.5, dtype=table.dtype)
        projected = self.per_layer_model_projection(embeds) * self.projection_scale
        projected = self.per_layer_projection_norm(projected.view(rows))
        out: torch.Tensor = (projected + table.view(rows)) * 2**-0.5
        return out
