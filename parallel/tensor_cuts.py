"""Cutting one rank's share out of a loaded weight: runs of heads, rows and columns.

``tensor_shards`` and ``tensor_mamba`` build every rank's layers from these; the weights
are the loaded model's (the model dtype), cut before any quantisation.
"""

from __future__ import annotations

import torch
from torch import nn


def held_run(count: int, size: int, rank: int) -> tuple[int, int]:
    """The first of ``count`` heads (KV heads, B/C groups) ``rank`` of ``size`` keeps, and
    how many: an even share, or, with fewer than ranks, the one its query heads read
    (``size // count`` ranks keep each)::

        count 4, size 2:  rank 0 -> (0, 2)   rank 1 -> (2, 2)
        count 2, size 4:  ranks 0 1 -> (0, 1)   ranks 2 3 -> (1, 1)
    """
    if count >= size:
        share = count // size
        return rank * share, share
    return rank * count // size, 1


def param(tensor: torch.Tensor) -> nn.Parameter:
    """A contiguous frozen parameter of ``tensor``."""
    return nn.Parameter(tensor.contiguous(), requires_grad=False)


def rows_of(linear: nn.Module, rows: torch.Tensor | slice) -> nn.Linear:
    """``linear``'s output rows ``rows`` (and its bias's)."""
    assert isinstance(linear, nn.Linear), "tensor parallelism splits float weights"
    weight = linear.weight.detach()[rows]
    with torch.device("meta"):
        cut = nn.Linear(linear.in_features, weight.shape[0], bias=linear.bias is not None)
    cut.weight = param(weight)
    if linear.bias is not None:
        cut.bias = param(linear.bias.detach()[rows])
    return cut


def columns_of(linear: nn.Module, columns: torch.Tensor | slice) -> nn.Linear:
    """``linear``'s input columns ``columns``, without its bias (added after the sum)."""
    assert isinstance(linear, nn.Linear), "tensor parallelism splits float weights"
    weight = linear.weight.detach()[:, columns]
    with torch.device("meta"):
        cut = nn.Linear(weight.shape[1], linear.out_features, bias=False)
    cut.weight = param(weight)
    return cut


def bias_of(linear: nn.Module) -> torch.Tensor | None:
    """``linear``'s whole bias, detached, or None."""
    assert isinstance(linear, nn.Linear), "tensor parallelism splits float weights"
    return None if linear.bias is None else linear.bias.detach()


__all__ = ["bias_of", "columns_of", "held_run", "param", "rows_of"]
