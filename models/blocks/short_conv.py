"""LFM2's short convolution (``conv``) over a flat batch, its state in pages of the shared
pool (``blocks/state_mixer.py``): ``y = C * conv(B * x)``, a depthwise causal convolution
of ``K`` taps gated on both sides by projections of the layer's input::

    page row   [ conv state: hidden x (K-1) ]

Weight names follow LFM2 checkpoints (``in_proj``: B, C and x stacked; ``conv``;
``out_proj``).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.kernels.ssm import causal_conv1d_decode, causal_conv1d_states
from hybridkv.memory.state_pages import StepStates
from hybridkv.models.blocks.attention import LayerInputs
from hybridkv.models.blocks.state_mixer import Inputs, PagedStateMixer, State
from hybridkv.models.shapes.short_conv import ShortConvShape
from hybridkv.models.weights.cuts import TensorCut, channels_of, rows_of, summed_columns


class ShortConv(PagedStateMixer):
    """Input projection to B, C and x, the convolution of ``B * x``, ``C *`` its output."""

    def __init__(self, shape: ShortConvShape) -> None:
        super().__init__()
        self.shape = shape
        hidden, bias = shape.channels, shape.bias
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.conv = nn.Conv1d(hidden, hidden, shape.kernel, groups=hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)
        self.state_shapes = shape.parts

    def shard(self, cut: TensorCut) -> None:
        """Keep the rank's run of channels in B, C and x, in the convolution, and as
        columns of ``out_proj`` (summed over the group)."""
        width, share = self.shape.channels, self.shape.tensor_share(cut.size)
        mine = torch.arange(cut.rank * share.channels, (cut.rank + 1) * share.channels)
        rows = torch.cat((mine, width + mine, 2 * width + mine))
        self.set_submodule("in_proj", rows_of(self.in_proj, rows))
        self.conv = channels_of(self.conv, mine)
        self.set_submodule("out_proj", summed_columns(cut, self.out_proj, mine))
        self.shape = share
        self.state_shapes = share.parts

    def forward(self, hidden: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        states = inputs.metadata
        assert isinstance(states, StepStates), "a short-conv layer in a group without state"
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        out = self.mix((b * x, c), inputs.kv_cache, states, self.shape.channels)
        projected: torch.Tensor = self.out_proj(out)
        return projected

    def scan(self, xs: Inputs, state: State, counts: list[int]) -> tuple[torch.Tensor, State]:
        """The convolution over one request's tokens, its state after each count."""
        bx, c = xs
        out, states = causal_conv1d_states(
            bx, state[0][0], self.conv.weight[:, 0], self.conv.bias, counts, silu=False
        )
        return c * out, (states,)

    def step(self, xs: Inputs, state: State) -> tuple[torch.Tensor, State]:
        """One token per request through the convolution's window."""
        bx, c = xs
        out, after = causal_conv1d_decode(
            bx, state[0], self.conv.weight[:, 0], self.conv.bias, silu=False
        )
        return c * out, (after,)
