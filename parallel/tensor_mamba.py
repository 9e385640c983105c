"""A Mamba2 mixer's share on one tensor-parallel rank: its heads, their channels, their
B/C groups, and their state.

``in_proj`` writes, per token, the gate, the conv channels (x, B, C) and one time step
per head; a rank keeps the rows of its heads' channels and of its groups::

    in_proj rows   [ gate: inner | x: inner | B: G*N | C: G*N | dt: H ]
    rank r keeps     inner/tp      inner/tp   its groups' N each   H/tp

(``G`` groups of ``N`` state values; with fewer groups than ranks each rank keeps the one
its heads read). The convolution is per channel and the scan per head, so both run on the
rank's share alone, and the rank's state pages hold its heads' states only: the state of
one rank is ``Mamba2Shape.tensor_share``'s. ``out_proj`` sums over the ranks
(``SummedOverRanks``). The gated norm normalises groups of channels: where a group spans
several ranks its sum of squares is summed over them first (``SpreadGatedRMSNorm``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.models.blocks.mamba2 import Mamba2Mixer
from hybridkv.models.blocks.norms import GatedRMSNorm
from hybridkv.parallel.tensor_cuts import bias_of, columns_of, held_run, param, rows_of
from hybridkv.parallel.tensor_group import TensorRanks
from hybridkv.parallel.tensor_layers import SummedOverRanks, all_reduce


class SpreadGatedRMSNorm(nn.Module):
    """Mamba2's gated norm where each norm group spans ``spread`` ranks: a rank holds part
    of one group, so the squares are summed per group over the tensor group first.

    Args:
        weight: The rank's channels of the norm weight.
        group_index: The norm group its channels belong to, of ``num_groups``.
        group_size: Channels in a whole norm group.
        eps: The norm's epsilon.
        ranks: The tensor-parallel group.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        *,
        group_index: int,
        num_groups: int,
        group_size: int,
        eps: float,
        ranks: TensorRanks,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.group_index, self.num_groups, self.group_size = group_index, num_groups, group_size
        self.eps = eps
        self.ranks = ranks

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float() * F.silu(gate.float())
        sums = h.new_zeros(h.shape[0], self.num_groups)
        sums[:, self.group_index] = h.pow(2).sum(-1)
        all_reduce(sums, self.ranks)
        scale = torch.rsqrt(sums[:, self.group_index] / self.group_size + self.eps)
        return self.weight * (h * scale[:, None]).to(x.dtype)


def shard_mamba(mixer: Mamba2Mixer, ranks: TensorRanks) -> None:
    """Keep this rank's share of ``mixer``, in place."""
    rank, size = ranks.rank, ranks.size
    shape, share = mixer.shape, mixer.shape.tensor_share(size)
    inner, num_state = shape.intermediate_size, shape.num_groups * shape.state_size
    first_group, _ = held_run(shape.num_groups, size, rank)
    mine = torch.arange(rank * share.intermediate_size, (rank + 1) * share.intermediate_size)
    groups = torch.arange(
        first_group * shape.state_size, (first_group + share.num_groups) * shape.state_size
    )
    heads = torch.arange(rank * share.num_heads, (rank + 1) * share.num_heads)
    channels = torch.cat((mine, inner + groups, inner + num_state + groups))  # of x, B, C
    rows = torch.cat((mine, inner + channels, inner + shape.conv_dim + heads))
    mixer.set_submodule("in_proj", rows_of(mixer.in_proj, rows))
    conv = mixer.conv1d
    with torch.device("meta"):
        cut = nn.Conv1d(
            share.conv_dim,
            share.conv_dim,
            shape.conv_kernel,
            groups=share.conv_dim,
            bias=conv.bias is not None,
        )
    cut.weight = param(conv.weight.detach()[channels])
    if conv.bias is not None:
        cut.bias = param(conv.bias.detach()[channels])
    mixer.conv1d = cut
    mixer.dt_bias = param(mixer.dt_bias.detach()[heads])
    mixer.A_log = param(mixer.A_log.detach()[heads])
    mixer.D = param(mixer.D.detach()[heads])
    norm = mixer.norm
    weight = norm.weight.detach()[mine]
    if shape.num_groups % size == 0:  # whole norm groups on every rank
        local = GatedRMSNorm(share.intermediate_size, norm.group_size, norm.eps)
        local.weight = param(weight)
        mixer.norm = local
    else:
        spread = SpreadGatedRMSNorm(
            weight,
            group_index=rank * share.intermediate_size // norm.group_size,
            num_groups=shape.num_groups,
            group_size=norm.group_size,
            eps=norm.eps,
            ranks=ranks,
        )
        mixer.set_submodule("norm", spread)
    out = mixer.out_proj
    mixer.set_submodule("out_proj", SummedOverRanks(columns_of(out, mine), ranks, bias_of(out)))
    mixer.shape = share
    mixer._conv_values = share.conv_dim * (share.conv_kernel - 1)


__all__ = ["SpreadGatedRMSNorm", "shard_mamba"]
