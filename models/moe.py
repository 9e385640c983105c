"""Granite's MLPs: the shared gated MLP and the top-k mixture of experts beside it.

Weight names follow Granite 4.0-H checkpoints: ``shared_mlp.input_linear`` holds gate and
up stacked (``[2 * inner, hidden]``); ``block_sparse_moe.input_linear`` the same per
expert (``[experts, 2 * inner, hidden]``), ``output_linear`` ``[experts, hidden, inner]``,
and ``router.layer`` the routing logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SharedMLP(nn.Module):
    """``output(silu(gate) * up)`` with gate and up from one stacked projection."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * inner, bias=False)
        self.output_linear = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        out: torch.Tensor = self.output_linear(F.silu(gate) * up)
        return out


class _ExpertWeights(nn.Module):
    """One stacked parameter named ``weight``, as the checkpoint stores it."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class _Router(nn.Module):
    """The routing projection, as ``router.layer``."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden, num_experts, bias=False)


class MixtureOfExperts(nn.Module):
    """Each token goes to its ``top_k`` experts, weighted by the softmax of their logits."""

    def __init__(self, hidden: int, inner: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.router = _Router(hidden, num_experts)
        self.input_linear = _ExpertWeights(num_experts, 2 * inner, hidden)
        self.output_linear = _ExpertWeights(num_experts, hidden, inner)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.router.layer(x).float()
        top_logits, experts = logits.topk(self.top_k, dim=-1)  # [T, k]
        weights = torch.softmax(top_logits, dim=-1).to(x.dtype)
        out = torch.zeros_like(x)
        # Tokens grouped by expert: one pair of matmuls per expert any token chose.
        for expert in torch.unique(experts).tolist():
            tokens, slot = torch.where(experts == expert)
            gate, up = F.linear(x[tokens], self.input_linear.weight[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.output_linear.weight[expert])
            out.index_add_(0, tokens, y * weights[tokens, slot, None])
        return out
