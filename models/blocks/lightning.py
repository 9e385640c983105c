"""Lightning attention (MiniMax's ``linear_attention`` layers) over a flat batch, its state
in pages of the shared pool (``blocks/state_mixer.py``)::

    page row   [ memory: heads x head_dim (values) x head_dim (keys) ]

Linear attention whose memory decays by a constant rate per head: ``S_t = exp(-s) S_{t-1}
+ v_t k_t^T`` and ``o_t = S_t q_t``, q, k and v the SiLU of one projection (``qkv_proj``),
the heads' outputs RMS-normalised together and gated (``output_gate``). That is Mamba2's
state space dual with a time step of 1, a decay of ``-s`` per head, B the keys and C the
queries, one group per head: the same kernels (``kernels/ssm.py``) run both, chunked for
prefill and by the recurrence for decode. The rate of head h in layer l of L is
``2 ** (-8 (h + 1) / H) * (1 - l / (L - 1) + 1e-5)``, as MiniMax's checkpoints derive it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels.ssm import ssd_decode, ssd_scan_states
from hybridkv.memory.state_pages import StepStates
from hybridkv.models.blocks.attention import LayerInputs
from hybridkv.models.blocks.norms import RMSNorm, SpreadGatedRMSNorm
from hybridkv.models.blocks.state_mixer import Inputs, PagedStateMixer, State
from hybridkv.models.shapes.lightning import LightningShape
from hybridkv.models.weights.cuts import TensorCut, rows_of, summed_columns

#: The SSD chunk the prefill scans by (the result does not depend on it).
_CHUNK = 64
#: Buffers a transformers checkpoint may hold beside the rates, derived from them here.
_DERIVED = ("query_decay", "key_decay", "diagonal_decay")


class LightningAttention(PagedStateMixer):
    """Projection, decayed linear attention, grouped norm and output gate."""

    slope_rate: torch.Tensor

    def __init__(self, shape: LightningShape, layer: int) -> None:
        super().__init__()
        self.shape = shape
        self.layer = layer
        width = shape.num_heads * shape.head_dim
        self.qkv_proj = nn.Linear(shape.hidden_size, 3 * width, bias=False)
        self.output_gate = nn.Linear(shape.hidden_size, width, bias=False)
        self.out_proj = nn.Linear(width, shape.hidden_size, bias=False)
        # transformers' default eps, not the config's
        self.norm: RMSNorm | SpreadGatedRMSNorm = RMSNorm(width, 1e-6, 0.0)
        self.register_buffer("slope_rate", torch.empty(shape.num_heads, 1, 1))
        self.state_shapes = shape.parts

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """The rates as the checkpoint has them, or derived where it has none; the decays
        transformers keeps beside them dropped (the kernels derive their own)."""
        for name in _DERIVED:
            state_dict.pop(f"{prefix}{name}", None)
        state_dict.setdefault(f"{prefix}slope_rate", self._rates())
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _rates(self) -> torch.Tensor:
        heads, layers = self.shape.num_heads, self.shape.num_layers
        base = 1 / (2 ** (8 / heads))
        depth = 1 - self.layer / (layers - 1 + 1e-5) + 1e-5
        return (base ** (torch.arange(heads) + 1) * depth)[:, None, None]

    def shard(self, cut: TensorCut) -> None:
        """Keep the rank's run of heads: their q, k and v rows (interleaved per head in
        ``qkv_proj``), gate rows, rates and memories; ``out_proj`` summed over the group.
        The output norm spans every head, so each token's sum of squares is summed over
        the group before it scales (one value a token)."""
        shape, share = self.shape, self.shape.tensor_share(cut.size)
        heads = torch.arange(cut.rank * share.num_heads, (cut.rank + 1) * share.num_heads)
        width = share.num_heads * shape.head_dim
        mine = torch.arange(cut.rank * width, (cut.rank + 1) * width)
        qkv = torch.arange(3 * shape.head_dim)
        self.set_submodule(
            "qkv_proj", rows_of(self.qkv_proj, (heads[:, None] * 3 * shape.head_dim + qkv).view(-1))
        )
        self.set_submodule("output_gate", rows_of(self.output_gate, mine))
        norm = self.norm
        assert isinstance(norm, RMSNorm)
        self.norm = SpreadGatedRMSNorm(
            norm.weight.detach()[mine],
            group_index=0,
            num_groups=1,
            group_size=shape.num_heads * shape.head_dim,
            eps=norm.eps,
            reduce=cut.all_reduce,
            norm_first=True,
        )
        self.slope_rate = self.slope_rate[heads].contiguous()
        self.set_submodule("out_proj", summed_columns(cut, self.out_proj, mine))
        self.shape = share
        self.state_shapes = share.parts

    def forward(self, hidden: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        shape = self.shape
        qkv = F.silu(self.qkv_proj(hidden)).view(-1, shape.num_heads, 3 * shape.head_dim)
        q, k, v = torch.split(qkv, shape.head_dim, dim=-1)
        states = inputs.metadata
        assert isinstance(states, StepStates), "a lightning layer in a group without state"
        out = self.mix((v, k, q), inputs.kv_cache, states, shape.num_heads * shape.head_dim)
        gated = torch.sigmoid(self.output_gate(hidden)) * self.norm(out)
        projected: torch.Tensor = self.out_proj(gated)
        return projected

    def scan(self, xs: Inputs, state: State, counts: list[int]) -> tuple[torch.Tensor, State]:
        """The chunked form over one request's tokens."""
        v, k, q = xs
        ones = v.new_ones(v.shape[:2])
        y, states = ssd_scan_states(
            v, ones, self._decay(), k, q, self._no_skip(), state[0][0], _CHUNK, counts[:-1]
        )
        return y.reshape(v.shape[0], -1), (states,)

    def step(self, xs: Inputs, state: State) -> tuple[torch.Tensor, State]:
        """One token per request: the recurrence."""
        v, k, q = xs
        ones = v.new_ones(v.shape[:2])
        y, after = ssd_decode(v, ones, self._decay(), k, q, self._no_skip(), state[0])
        return y.reshape(v.shape[0], -1), (after,)

    def _decay(self) -> torch.Tensor:
        decay: torch.Tensor = -self.slope_rate.float().view(-1)
        return decay

    def _no_skip(self) -> torch.Tensor:
        return self.slope_rate.new_zeros(self.shape.num_heads)
