"""DeepSeek V4's hyper-connections: ``n`` residual streams a token, summed into each
sublayer's input and written back to each (``models/shapes/decoder.py`` has the formula).

Computed in float32 whatever the model's dtype, as the checkpoint's reference keeps them
(its ``_keep_in_fp32_modules``): the weights come from a softmax and ``sinkhorn_iters``
rounds of normalisation, which bfloat16 would round away.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.models.shapes.decoder import HyperConnections


def _normed(streams: torch.Tensor, eps: float) -> torch.Tensor:
    """``[T, n, hidden]`` -> ``[T, n * hidden]`` float32, RMS-normalised without a weight."""
    flat = streams.flatten(1).float()
    return F.rms_norm(flat, (flat.shape[-1],), eps=eps)


class HyperConnection(nn.Module):
    """The weights around one sublayer: ``fn`` projects the normalised streams to the
    ``pre``, ``post`` and ``comb`` logits, ``base`` and ``scale`` shift and scale them."""

    def __init__(self, shape: HyperConnections, hidden: int, eps: float) -> None:
        super().__init__()
        n = shape.streams
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))
        self.shape, self.norm_eps = shape, eps

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, n, hidden]`` -> the sublayer's input ``[T, hidden]``, and ``post``
        ``[T, n]`` and ``comb`` ``[T, n, n]`` (float32) to write its output back with."""
        n, eps = self.shape.streams, self.shape.eps
        mixes = F.linear(_normed(streams, self.norm_eps), self.fn.float())
        pre, post, comb = torch.split(mixes, [n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = torch.split(self.base.float(), [n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre * pre_s + pre_b) + eps
        post = 2 * torch.sigmoid(post * post_s + post_b)
        comb = torch.softmax(comb.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(self.shape.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return collapsed, post, comb

    @staticmethod
    def write_back(
        streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """The streams after a sublayer's output ``out`` ``[T, hidden]``:
        ``post * out + comb^T streams``."""
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """The streams summed into one before the final norm (``hc_head``)."""

    def __init__(self, shape: HyperConnections, hidden: int, eps: float) -> None:
        super().__init__()
        n = shape.streams
        self.hc_fn = nn.Parameter(torch.empty(n, n * hidden))
        self.hc_base = nn.Parameter(torch.empty(n))
        self.hc_scale = nn.Parameter(torch.empty(1))
        self.eps, self.norm_eps = shape.eps, eps

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """``[T, n, hidden]`` -> ``[T, hidden]``."""
        mixes = F.linear(_normed(streams, self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
