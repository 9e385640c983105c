"""One multi-token prediction layer (``models/shapes/mtp.py`` has the picture): two
norms, a projection of their concatenation, one decoder layer of the family and a final
norm; the model's embedding and LM head serve it."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.blocks.attention import LayerInputs
from hybridkv.models.blocks.decoder import DecoderLayer
from hybridkv.models.blocks.norms import config_norm
from hybridkv.models.config import ModelConfig
from hybridkv.models.shapes.decoder import DecoderShape


class MtpLayer(nn.Module):
    """An MTP layer whose block is layer ``layer`` of ``config`` (the decoder's layers
    followed by the MTP layers'), put together as ``decoder`` says."""

    def __init__(self, config: ModelConfig, layer: int, decoder: DecoderShape) -> None:
        super().__init__()
        width = config.hidden_size
        self.embed_norm = config_norm(config, width)
        self.hidden_norm = config_norm(config, width)
        self.proj = nn.Linear(2 * width, width, bias=False)
        self.block = DecoderLayer(config, layer, decoder)
        self.final_norm = config_norm(config, width)

    def forward(
        self, hidden: torch.Tensor, embeds: torch.Tensor, inputs: LayerInputs
    ) -> torch.Tensor:
        """``[num_tokens, hidden]``: the layer's normalised output at each position, from
        the hidden states there (the target's, or the output of the proposal before) and
        the embeddings of the tokens after each; the LM head reads it, and so does the
        next proposal."""
        joined = torch.cat([self.embed_norm(embeds), self.hidden_norm(hidden)], dim=-1)
        out: torch.Tensor = self.final_norm(self.block(self.proj(joined), inputs))
        return out


__all__ = ["MtpLayer"]
