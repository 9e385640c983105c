"""One multi-token prediction layer (``models/shapes/mtp.py`` has the picture): the
embedding of the next token and the hidden state, each normalised and projected, one
decoder layer of the family, a final norm; the model's embedding and LM head serve it.

Most families join the two halves in one projection of their concatenation, and the
layer's normalised output is both what the head reads and what the next proposal reads.
DeepSeek V4's residual is several streams (hyper-connections): the hidden state's
projection applies to each stream, the embedding's is added to every one, the block
carries the streams, and the layer's own ``hc_head`` sums them before the final norm the
head reads, while the next proposal reads the streams themselves.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.blocks.attention import LayerInputs
from hybridkv.models.blocks.decoder import DecoderLayer
from hybridkv.models.blocks.hyper_connections import HyperHead
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
        self.block = DecoderLayer(config, layer, decoder)
        self.final_norm = config_norm(config, width)
        hyper = config.hyper
        self.hc_head = None if hyper is None else HyperHead(hyper, width, config.rms_norm_eps)
        if hyper is None:
            self.proj = nn.Linear(2 * width, width, bias=False)
        else:
            self.embed_proj = nn.Linear(width, width, bias=False)
            self.hidden_proj = nn.Linear(width, width, bias=False)

    @property
    def reads_streams(self) -> bool:
        """Whether it reads the model's residual streams (before their ``hc_head`` and
        the final norm), not its normalised hidden state."""
        return self.hc_head is not None

    def forward(
        self, hidden: torch.Tensor, embeds: torch.Tensor, inputs: LayerInputs
    ) -> torch.Tensor:
        """At each position, from the hidden state there (the model's, or the output of
        the proposal before) and the embedding of the token after it: what the next
        proposal reads there (``[num_tokens, hidden]`` normalised, or the streams)."""
        if self.hc_head is None:
            joined = torch.cat([self.embed_norm(embeds), self.hidden_norm(hidden)], dim=-1)
            out: torch.Tensor = self.final_norm(self.block(self.proj(joined), inputs))
            return out
        streams = self.hidden_proj(self.hidden_norm(hidden))
        streams = streams + self.embed_proj(self.embed_norm(embeds)).unsqueeze(1)
        out = self.block(streams, inputs)
        return out

    def head_input(self, out: torch.Tensor) -> torch.Tensor:
        """What the LM head reads of :meth:`forward`'s output."""
        if self.hc_head is None:
            return out
        summed: torch.Tensor = self.final_norm(self.hc_head(out))
        return summed


__all__ = ["MtpLayer"]
