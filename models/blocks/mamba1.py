"""Mamba1 (Jamba's ``mamba``) over a flat batch, its state in pages of the shared pool
(``blocks/state_mixer.py``)::

    page row   [ conv state: channels x (K-1) | SSM state: channels x state ]

Weight names follow Jamba checkpoints (``in_proj``, ``conv1d``, ``x_proj``, ``dt_proj``,
``A_log``, ``D``, ``out_proj`` and the RMSNorms of the time step, B and C), which are
Mamba's and Falcon-Mamba's too (their norms without weights, or none).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels.selective_scan import selective_scan_decode, selective_scan_states
from hybridkv.kernels.ssm import causal_conv1d_decode, causal_conv1d_states
from hybridkv.memory.state_pages import StepStates
from hybridkv.models.blocks.attention import LayerInputs
from hybridkv.models.blocks.norms import RMSNorm, WeightlessRMSNorm
from hybridkv.models.blocks.state_mixer import Inputs, PagedStateMixer, State
from hybridkv.models.shapes.mamba1 import Mamba1Shape
from hybridkv.models.weights.cuts import TensorCut, channels_of, param, rows_of, summed_columns


class Mamba1Mixer(PagedStateMixer):
    """Projection to x and a gate, causal conv of x, selective scan, gated output."""

    def __init__(self, shape: Mamba1Shape, eps: float) -> None:
        super().__init__()
        self.shape = shape
        channels, size, rank = shape.channels, shape.state_size, shape.dt_rank
        self.in_proj = nn.Linear(shape.hidden_size, 2 * channels, bias=shape.proj_bias)
        self.conv1d = nn.Conv1d(
            channels, channels, shape.conv_kernel, groups=channels, bias=shape.conv_bias
        )
        self.x_proj = nn.Linear(channels, rank + 2 * size, bias=False)
        self.dt_proj = nn.Linear(rank, channels, bias=True)
        self.A_log = nn.Parameter(torch.empty(channels, size))
        self.D = nn.Parameter(torch.empty(channels))
        self.out_proj = nn.Linear(channels, shape.hidden_size, bias=shape.proj_bias)
        self.dt_layernorm, self.b_layernorm, self.c_layernorm = _selection_norms(shape, eps)
        self.state_shapes = shape.parts

    def shard(self, cut: TensorCut) -> None:
        """Keep the rank's run of channels: their rows of ``in_proj`` (x and gate), of
        the convolution, of ``dt_proj`` and the scan's ``A`` and ``D``, and their state.
        ``x_proj`` reads every channel, so its columns are cut and its output (the time
        step's rank and B, C: a few dozen values a token) summed over the group before
        the selection norms; ``out_proj`` is summed over the group too::

            in_proj rows   [ x: channels | gate: channels ]
            rank r keeps     channels/tp   channels/tp
        """
        share = self.shape.tensor_share(cut.size)
        mine = torch.arange(cut.rank * share.channels, (cut.rank + 1) * share.channels)
        self.set_submodule(
            "in_proj", rows_of(self.in_proj, torch.cat((mine, self.shape.channels + mine)))
        )
        self.conv1d = channels_of(self.conv1d, mine)
        self.set_submodule("x_proj", summed_columns(cut, self.x_proj, mine))
        self.set_submodule("dt_proj", rows_of(self.dt_proj, mine))
        self.A_log = param(self.A_log.detach()[mine])
        self.D = param(self.D.detach()[mine])
        self.set_submodule("out_proj", summed_columns(cut, self.out_proj, mine))
        self.shape = share
        self.state_shapes = share.parts

    def forward(self, hidden: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        states = inputs.metadata
        assert isinstance(states, StepStates), "a Mamba1 layer in a group without state"
        x, gate = self.in_proj(hidden).chunk(2, dim=-1)
        out = self.mix((x,), inputs.kv_cache, states, self.shape.channels)
        projected: torch.Tensor = self.out_proj(out * F.silu(gate))
        return projected

    def scan(self, xs: Inputs, state: State, counts: list[int]) -> tuple[torch.Tensor, State]:
        """The causal conv and the selective scan over one request's tokens."""
        conv_state, ssm_state = state
        mixed, conv_states = causal_conv1d_states(
            xs[0], conv_state[0], self.conv1d.weight[:, 0], self.conv1d.bias, counts
        )
        dt, b, c = self._selection(mixed)
        y, ssm_states = selective_scan_states(
            mixed, dt, self._a(), b, c, self.D, ssm_state[0], counts
        )
        return y, (conv_states, ssm_states)

    def step(self, xs: Inputs, state: State) -> tuple[torch.Tensor, State]:
        """One token per request: the conv window and the scan's recurrence."""
        conv_state, ssm_state = state
        mixed, conv_after = causal_conv1d_decode(
            xs[0], conv_state, self.conv1d.weight[:, 0], self.conv1d.bias
        )
        dt, b, c = self._selection(mixed)
        y, ssm_after = selective_scan_decode(mixed, dt, self._a(), b, c, self.D, ssm_state)
        return y, (conv_after, ssm_after)

    def _selection(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each token's time step (after ``dt_proj`` and softplus), B and C, normed."""
        shape = self.shape
        rank, size = shape.dt_rank, shape.state_size
        dt, b, c = torch.split(self.x_proj(mixed), [rank, size, size], dim=-1)
        dt = F.softplus(self.dt_proj(self.dt_layernorm(dt)))
        return dt, self.b_layernorm(b), self.c_layernorm(c)

    def _a(self) -> torch.Tensor:
        return -torch.exp(self.A_log.float())


def _selection_norms(shape: Mamba1Shape, eps: float) -> tuple[nn.Module, nn.Module, nn.Module]:
    """The norms of the time step, B and C: RMSNorms with a weight (Jamba's), without
    one (Falcon-Mamba's), or none (Mamba's)."""
    if shape.selection_norm == "none":
        return nn.Identity(), nn.Identity(), nn.Identity()
    eps = shape.selection_eps if shape.selection_eps is not None else eps
    if shape.selection_norm == "weightless":
        return WeightlessRMSNorm(eps), WeightlessRMSNorm(eps), WeightlessRMSNorm(eps)
    rank, size = shape.dt_rank, shape.state_size
    return RMSNorm(rank, eps, 0.0), RMSNorm(size, eps, 0.0), RMSNorm(size, eps, 0.0)
