"""Cutting one tensor-parallel rank's share out of a loaded block: runs of heads, rows
and columns, and what a block needs from its group to cut itself (:class:`TensorCut`).

Each block of ``models/blocks`` has ``shard(cut)``, which keeps the rank's share of its
weights in place; ``hybridkv.parallel.tensor_shards`` calls it with the rank's group. A
float weight is cut as loaded; a quantised one (``--weights int8``/``int4``: the whole
model is quantised first) is cut in its stored form, rows with their scales and columns
under the whole row's, so that the ranks' shares sum to what one process's layer computes.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from hybridkv.models.weights.quantized_linear import QuantizedLinear


class TensorCut(Protocol):
    """One rank of a tensor-parallel group, as a block cutting itself sees it."""

    @property
    def rank(self) -> int:
        """This rank's index in the group."""
        ...

    @property
    def size(self) -> int:
        """The group's size (tp)."""
        ...

    def summed(self, part: nn.Module, bias: torch.Tensor | None) -> nn.Module:
        """A module running ``part`` (whose output on each rank is a partial sum: a
        row-split linear), summing its output over the group, then adding ``bias``."""
        ...

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group, in place."""
        ...


@runtime_checkable
class Shardable(Protocol):
    """A block that keeps one rank's share of itself (and of the blocks inside it)."""

    def shard(self, cut: TensorCut) -> None:
        """Keep ``cut``'s rank's share of the weights, in place."""
        ...


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


def channels_of(conv: nn.Conv1d, channels: torch.Tensor) -> nn.Conv1d:
    """A depthwise (one filter per channel) ``conv``'s ``channels``, with their bias."""
    with torch.device("meta"):
        cut = nn.Conv1d(
            len(channels),
            len(channels),
            conv.kernel_size[0],
            groups=len(channels),
            bias=conv.bias is not None,
        )
    cut.weight = param(conv.weight.detach()[channels])
    if conv.bias is not None:
        cut.bias = param(conv.bias.detach()[channels])
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


def summed_columns(cut: TensorCut, linear: nn.Module, columns: torch.Tensor | slice) -> nn.Module:
    """``linear``'s input ``columns``, summed over the group, its bias added once."""
    return cut.summed(columns_of(linear, columns), bias_of(linear))


def gated_share(
    cut: TensorCut, gate: nn.Module, up: nn.Module, down: nn.Module, *, summed: bool = True
) -> tuple[nn.Module, nn.Module, nn.Module]:
    """A gated MLP's share: the rank's run of the width in ``gate`` and ``up`` rows and in
    ``down`` columns, summed over the group unless the caller sums (``summed``)."""
    width = _out_features(gate) // cut.size
    held = slice(cut.rank * width, (cut.rank + 1) * width)
    down = summed_columns(cut, down, held) if summed else columns_of(down, held)
    return rows_of(gate, held), rows_of(up, held), down


def _out_features(linear: nn.Module) -> int:
    assert isinstance(linear, (nn.Linear, QuantizedLinear)), "tensor parallelism splits linears"
    return int(linear.out_features)
