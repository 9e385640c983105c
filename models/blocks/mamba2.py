"""The Mamba2 mixer over a flat batch, its state in pages of the shared pool.

Weight names follow Bamba and Granite 4.0-H checkpoints (``in_proj``, ``conv1d``,
``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``). The order of a step's requests
and the state pages are ``blocks/state_mixer.py``'s; a page of the layer is one float32
row::

    page row   [ conv state: conv_dim x (K-1) | SSM state: heads x head_dim x state_size ]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels.ssm import (
    causal_conv1d_decode,
    causal_conv1d_states,
    ssd_decode,
    ssd_scan_states,
)
from hybridkv.memory.state_pages import StepStates
from hybridkv.models.blocks.attention import LayerInputs
from hybridkv.models.blocks.norms import GatedRMSNorm, SpreadGatedRMSNorm
from hybridkv.models.blocks.state_mixer import Inputs, PagedStateMixer, State
from hybridkv.models.shapes.mamba2 import Mamba2Shape
from hybridkv.models.weights.cuts import (
    TensorCut,
    channels_of,
    held_run,
    param,
    rows_of,
    summed_columns,
)


class Mamba2Mixer(PagedStateMixer):
    """Projections, causal conv, SSD scan (prefill) or recurrence (decode), gated norm.

    ``inputs.kv_cache`` is the layer's state pages ``[num_blocks, state_values]`` float32,
    ``inputs.metadata`` its group's :class:`StepStates` for the step.
    """

    def __init__(self, shape: Mamba2Shape, eps: float) -> None:
        super().__init__()
        self.shape = shape
        inner, heads = shape.intermediate_size, shape.num_heads
        self.in_proj = nn.Linear(
            shape.hidden_size, inner + shape.conv_dim + heads, bias=shape.proj_bias
        )
        self.conv1d = nn.Conv1d(
            shape.conv_dim,
            shape.conv_dim,
            shape.conv_kernel,
            groups=shape.conv_dim,
            bias=shape.conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.D = nn.Parameter(torch.empty(heads))
        # Falcon-H1's may have no norm, only the gate (``Mamba2Shape.gate``).
        self.norm: nn.Module | None = None
        if shape.gate != "gate_only":
            first, eps = shape.gate == "norm_then_gate", shape.norm_eps or eps
            self.norm = GatedRMSNorm(inner, inner // shape.num_groups, eps, norm_first=first)
        self.out_proj = nn.Linear(inner, shape.hidden_size, bias=shape.out_bias)
        self.state_shapes = shape.parts

    def shard(self, cut: TensorCut) -> None:
        """Keep the rank's heads, their channels, their B/C groups (an even run, or, with
        fewer than ranks, the one its heads read) and their state; ``out_proj`` is summed
        over the group, and a norm group spread over ranks sums its squares over them:

            in_proj rows   [ gate: inner | x: inner | B: G*N | C: G*N | dt: H ]
            rank r keeps     inner/tp      inner/tp   its groups' N each   H/tp

        The convolution is per channel and the scan per head, so both run on the share
        alone, and the rank's state pages hold its heads' states only
        (``Mamba2Shape.tensor_share``).
        """
        rank, size = cut.rank, cut.size
        shape, share = self.shape, self.shape.tensor_share(size)
        inner, num_state = shape.intermediate_size, shape.num_groups * shape.state_size
        first_group, _ = held_run(shape.num_groups, size, rank)
        mine = torch.arange(rank * share.intermediate_size, (rank + 1) * share.intermediate_size)
        groups = torch.arange(
            first_group * shape.state_size, (first_group + share.num_groups) * shape.state_size
        )
        heads = torch.arange(rank * share.num_heads, (rank + 1) * share.num_heads)
        channels = torch.cat((mine, inner + groups, inner + num_state + groups))  # of x, B, C
        rows = torch.cat((mine, inner + channels, inner + shape.conv_dim + heads))
        self.set_submodule("in_proj", rows_of(self.in_proj, rows))
        self.conv1d = channels_of(self.conv1d, channels)
        self.dt_bias = param(self.dt_bias.detach()[heads])
        self.A_log = param(self.A_log.detach()[heads])
        self.D = param(self.D.detach()[heads])
        norm = self.norm
        if isinstance(norm, GatedRMSNorm):
            self.norm = _norm_share(norm, mine, cut, share, shape.num_groups)
        self.set_submodule("out_proj", summed_columns(cut, self.out_proj, mine))
        self.shape = share
        self.state_shapes = share.parts

    def forward(self, hidden: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        shape = self.shape
        gate, xbc, dt = self.in_proj(hidden).split(
            [shape.intermediate_size, shape.conv_dim, shape.num_heads], dim=-1
        )
        dt = F.softplus(dt + self.dt_bias).clamp(shape.dt_min, shape.dt_max)
        states = inputs.metadata
        assert isinstance(states, StepStates), "a Mamba2 layer in a group without state"
        out = self.mix((xbc, dt), inputs.kv_cache, states, shape.intermediate_size)
        gated = out * F.silu(gate) if self.norm is None else self.norm(out, gate)
        projected: torch.Tensor = self.out_proj(gated)
        return projected

    def scan(self, xs: Inputs, state: State, counts: list[int]) -> tuple[torch.Tensor, State]:
        """The causal conv and the SSD scan over one request's chunk."""
        xbc, dt = xs
        conv_state, ssm_state = state
        mixed, conv_states = causal_conv1d_states(
            xbc, conv_state[0], self.conv1d.weight[:, 0], self.conv1d.bias, counts
        )
        x, b, c = self._heads(mixed)
        y, ssm_states = ssd_scan_states(
            x, dt, self._a(), b, c, self.D, ssm_state[0], self.shape.chunk_size, counts[:-1]
        )
        return y.reshape(xbc.shape[0], -1), (conv_states, ssm_states)

    def step(self, xs: Inputs, state: State) -> tuple[torch.Tensor, State]:
        """One token per request: the conv window and the SSM recurrence."""
        xbc, dt = xs
        conv_state, ssm_state = state
        mixed, conv_after = causal_conv1d_decode(
            xbc, conv_state, self.conv1d.weight[:, 0], self.conv1d.bias
        )
        x, b, c = self._heads(mixed)
        y, ssm_after = ssd_decode(x, dt, self._a(), b, c, self.D, ssm_state)
        return y.reshape(xbc.shape[0], -1), (conv_after, ssm_after)

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output ``[T, conv_dim]`` -> x ``[T, H, P]``, B and C ``[T, G, N]``."""
        shape = self.shape
        size = shape.num_groups * shape.state_size
        x, b, c = torch.split(mixed, [shape.intermediate_size, size, size], dim=-1)
        return (
            x.reshape(-1, shape.num_heads, shape.head_dim),
            b.reshape(-1, shape.num_groups, shape.state_size),
            c.reshape(-1, shape.num_groups, shape.state_size),
        )

    def _a(self) -> torch.Tensor:
        return -torch.exp(self.A_log.float())


def _norm_share(
    norm: GatedRMSNorm, mine: torch.Tensor, cut: TensorCut, share: Mamba2Shape, groups: int
) -> nn.Module:
    """The gated norm of a rank's channels ``mine``: whole groups where every rank holds
    whole groups, else one summing each group's squares over the ranks it spans."""
    weight = norm.weight.detach()[mine]
    if groups % cut.size == 0:  # whole norm groups on every rank
        local = GatedRMSNorm(
            share.intermediate_size, norm.group_size, norm.eps, norm_first=norm.norm_first
        )
        local.weight = param(weight)
        return local
    return SpreadGatedRMSNorm(
        weight,
        group_index=cut.rank * share.intermediate_size // norm.group_size,
        num_groups=groups,
        group_size=norm.group_size,
        eps=norm.eps,
        reduce=cut.all_reduce,
        norm_first=norm.norm_first,
    )
