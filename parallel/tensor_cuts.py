"""Cutting one rank's share out of a loaded weight: runs of heads, rows and columns.

``tensor_shards`` and ``tensor_mamba`` build every rank's layers from these. A float
weight is cut as loaded; a quantised one (``--weights int8``/``int4``: the whole model is
quantised first) is cut in its stored form, rows with their scales and columns under the
whole row's, so that the ranks' shares sum to what one process's layer computes.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.weights.quantized_linear import QuantizedLinear


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


def rows_of(linear: nn.Module, rows: torch.Tensor | slice) -> nn.Module:
    """``linear``'s output rows ``rows`` (and its bias's)."""
    if isinstance(linear, QuantizedLinear):
        return linear.take_rows(rows)
    assert isinstance(linear, nn.Linear), "tensor parallelism splits linear layers"
    weight = linear.weight.detach()[rows]
    with torch.device("meta"):
        cut = nn.Linear(linear.in_features, weight.shape[0], bias=linear.bias is not None)
    cut.weight = param(weight)
    if linear.bias is not None:
        cut.bias = param(linear.bias.detach()[rows])
    return cut


def columns_of(linear: nn.Module, columns: torch.Tensor | slice) -> nn.Module:
    """``linear``'s input columns ``columns``, without its bias (added after the sum)."""
    if isinstance(linear, QuantizedLinear):
        return linear.take_columns(_as_slice(columns))
    assert isinstance(linear, nn.Linear), "tensor parallelism splits linear layers"
    weight = linear.weight.detach()[:, columns]
    with torch.device("meta"):
        cut = nn.Linear(weight.shape[1], linear.out_features, bias=False)
    cut.weight = param(weight)
    return cut


def bias_of(linear: nn.Module) -> torch.Tensor | None:
    """``linear``'s whole bias, detached, or None."""
    assert isinstance(linear, (nn.Linear, QuantizedLinear)), "tensor parallelism splits linears"
    return None if linear.bias is None else linear.bias.detach()


def _as_slice(columns: torch.Tensor | slice) -> slice:
    """A run of consecutive column indices as a slice (stored forms cut runs only)."""
    if isinstance(columns, slice):
        return columns
    first, count = int(columns[0]), len(columns)
    if not torch.equal(columns, torch.arange(first, first + count, device=columns.device)):
        raise ValueError("quantised layers are cut on runs of consecutive columns")
    return slice(first, first + count)


__all__ = ["bias_of", "columns_of", "held_run", "param", "rows_of"]
