"""Gated DeltaNet (Qwen3-Next's and Qwen3.5's ``linear_attn``) and Kimi Delta Attention
(Kimi Linear's ``linear_attention`` layers) over a flat batch, the state in pages of the
shared pool (``blocks/state_mixer.py``)::

    page row   [ conv state: (q, k, v channels) x (K-1) | memory: v heads x Dk x Dv ]

Weight names follow Qwen3.5 checkpoints (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``, ``conv1d``, ``dt_bias``, ``A_log``, ``norm``, ``out_proj``); Qwen3-Next's
``in_proj_qkvz`` and ``in_proj_ba``, grouped by key head, are read into them at load.
Kimi Delta Attention's decay per key channel comes from two projections (``f_a_proj``,
``f_b_proj``: our ``in_proj_a``) and a bias per channel, its output gate from two more
(``g_a_proj``, ``g_b_proj``: our ``in_proj_z``), through a sigmoid.
The convolution and its SiLU are Mamba2's (``kernels/ssm.py``), the memory's update the
gated delta rule (``kernels/delta_rule.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels.delta_rule import delta_rule_decode, delta_rule_states
from hybridkv.kernels.ssm import causal_conv1d_decode, causal_conv1d_states
from hybridkv.memory.state_pages import StepStates
from hybridkv.models.blocks.attention import LayerInputs
from hybridkv.models.blocks.norms import NormThenGate
from hybridkv.models.blocks.state_mixer import Inputs, PagedStateMixer, State
from hybridkv.models.shapes.deltanet import DeltaNetShape
from hybridkv.models.weights.cuts import TensorCut, channels_of, param, rows_of, summed_columns

#: OLMo Hybrid's names of the mixer's parts -> Qwen3.5's.
_OLMO_NAMES = {
    "a_proj.weight": "in_proj_a.weight",
    "b_proj.weight": "in_proj_b.weight",
    "g_proj.weight": "in_proj_z.weight",
    "o_proj.weight": "out_proj.weight",
    "o_norm.weight": "norm.weight",
}
#: Kimi Delta Attention's projections of the decay and the output gate -> ours (two
#: layers each where they are low-rank).
_KDA_NAMES = {
    "f_proj.weight": "in_proj_a.weight",
    "f_a_proj.weight": "in_proj_a.0.weight",
    "f_b_proj.weight": "in_proj_a.1.weight",
    "g_a_proj.weight": "in_proj_z.0.weight",
    "g_b_proj.weight": "in_proj_z.1.weight",
}


def _projection(hidden: int, out: int, rank: int) -> nn.Module:
    """``hidden -> out``, through ``rank`` where that is not 0 (two layers, no bias)."""
    if not rank:
        return nn.Linear(hidden, out, bias=False)
    return nn.Sequential(nn.Linear(hidden, rank, bias=False), nn.Linear(rank, out, bias=False))


def _rows(projection: nn.Module, rows: torch.Tensor) -> nn.Module:
    """The output ``rows`` of a projection of :func:`_projection` (of its last layer)."""
    if isinstance(projection, nn.Sequential):
        return nn.Sequential(projection[0], rows_of(projection[1], rows))
    return rows_of(projection, rows)


class GatedDeltaNet(PagedStateMixer):
    """Projections, causal conv, the gated delta rule, a gated norm per value head."""

    def __init__(self, shape: DeltaNetShape, eps: float) -> None:
        super().__init__()
        self.shape = shape
        hidden, heads = shape.hidden_size, shape.num_value_heads
        # Kimi Delta Attention: a decay per key channel (both gates of a low rank in Kimi
        # Linear's).
        rank = shape.gate_rank
        decays = shape.key_dim if shape.kda else heads
        self.in_proj_qkv = nn.Linear(hidden, shape.conv_dim, bias=False)
        self.in_proj_z = _projection(hidden, shape.value_dim, rank)
        self.in_proj_b = nn.Linear(hidden, heads, bias=False)
        self.in_proj_a = _projection(hidden, decays, rank)
        self.conv1d = nn.Conv1d(
            shape.conv_dim, shape.conv_dim, shape.conv_kernel, groups=shape.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.empty(decays))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.norm = NormThenGate(shape.value_head_dim, shape.norm_eps or eps, sigmoid=shape.kda)
        self.out_proj = nn.Linear(shape.value_dim, hidden, bias=False)
        self.state_shapes = shape.parts

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Qwen3-Next's projections, each key head's q, k, v, z (and b, a) side by side,
        read as Qwen3.5's: every head's q, then k, v, z (b, a); OLMo Hybrid's separate
        ones (``q_proj`` ... ``g_proj``, ``o_proj``, ``o_norm``) and Kimi Delta
        Attention's (those, its low-rank gates, its forget gate's ``A_log`` of one value
        a head) under Qwen3.5's names."""
        shape = self.shape
        for theirs, ours in _KDA_NAMES.items():
            if f"{prefix}{theirs}" in state_dict:
                state_dict[f"{prefix}{ours}"] = state_dict.pop(f"{prefix}{theirs}")
        a_log = state_dict.get(f"{prefix}A_log")
        if a_log is not None:
            state_dict[f"{prefix}A_log"] = a_log.reshape(-1)
        for theirs, ours in (("{}_proj", "in_proj_qkv"), ("{}_conv1d", "conv1d")):
            parts = [state_dict.pop(f"{prefix}{theirs.format(n)}.weight", None) for n in "qkv"]
            if all(p is not None for p in parts):
                state_dict[f"{prefix}{ours}.weight"] = torch.cat(parts)
        for theirs, ours in _OLMO_NAMES.items():
            if f"{prefix}{theirs}" in state_dict:
                state_dict[f"{prefix}{ours}"] = state_dict.pop(f"{prefix}{theirs}")
        ratio = shape.num_value_heads // shape.num_key_heads
        qkvz = state_dict.pop(f"{prefix}in_proj_qkvz.weight", None)
        if qkvz is not None:
            key, value = shape.key_head_dim, ratio * shape.value_head_dim
            q, k, v, z = qkvz.view(shape.num_key_heads, -1, qkvz.shape[-1]).split(
                [key, key, value, value], dim=1
            )
            flat = [part.reshape(-1, qkvz.shape[-1]) for part in (q, k, v, z)]
            state_dict[f"{prefix}in_proj_qkv.weight"] = torch.cat(flat[:3])
            state_dict[f"{prefix}in_proj_z.weight"] = flat[3]
        ba = state_dict.pop(f"{prefix}in_proj_ba.weight", None)
        if ba is not None:
            b, a = ba.view(shape.num_key_heads, 2 * ratio, -1).split([ratio, ratio], dim=1)
            state_dict[f"{prefix}in_proj_b.weight"] = b.reshape(-1, ba.shape[-1])
            state_dict[f"{prefix}in_proj_a.weight"] = a.reshape(-1, ba.shape[-1])
        super()._load_from_state_dict(state_dict, prefix, *args)

    def shard(self, cut: TensorCut) -> None:
        """Keep the rank's key heads and the value heads they serve: their rows of the
        projections and channels of the convolution, their gates; ``out_proj`` summed
        over the group."""
        shape, share = self.shape, self.shape.tensor_share(cut.size)
        keys = torch.arange(cut.rank * share.key_dim, (cut.rank + 1) * share.key_dim)
        values = torch.arange(cut.rank * share.value_dim, (cut.rank + 1) * share.value_dim)
        heads = torch.arange(
            cut.rank * share.num_value_heads, (cut.rank + 1) * share.num_value_heads
        )
        channels = torch.cat((keys, shape.key_dim + keys, 2 * shape.key_dim + values))
        decays = keys if shape.kda else heads
        self.set_submodule("in_proj_qkv", rows_of(self.in_proj_qkv, channels))
        self.set_submodule("in_proj_z", _rows(self.in_proj_z, values))
        self.set_submodule("in_proj_b", rows_of(self.in_proj_b, heads))
        self.set_submodule("in_proj_a", _rows(self.in_proj_a, decays))
        self.conv1d = channels_of(self.conv1d, channels)
        self.dt_bias = param(self.dt_bias.detach()[decays])
        self.A_log = param(self.A_log.detach()[heads])
        self.set_submodule("out_proj", summed_columns(cut, self.out_proj, values))
        self.shape = share
        self.state_shapes = share.parts

    def forward(self, hidden: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        shape = self.shape
        states = inputs.metadata
        assert isinstance(states, StepStates), "a DeltaNet layer in a group without state"
        xs = (self.in_proj_qkv(hidden), self.in_proj_b(hidden), self.in_proj_a(hidden))
        out = self.mix(xs, inputs.kv_cache, states, shape.value_dim)
        heads = (hidden.shape[0], shape.num_value_heads, shape.value_head_dim)
        gate = self.in_proj_z(hidden).view(heads)
        normed = self.norm(out.view(heads), gate).reshape(hidden.shape[0], shape.value_dim)
        projected: torch.Tensor = self.out_proj(normed)
        return projected

    def scan(self, xs: Inputs, state: State, counts: list[int]) -> tuple[torch.Tensor, State]:
        """The conv and the chunked delta rule over one request's tokens."""
        qkv, b, a = xs
        conv_state, memory = state
        mixed, conv_states = causal_conv1d_states(
            qkv, conv_state[0], self.conv1d.weight[:, 0], None, counts
        )
        q, k, v = self._heads(mixed)
        g, beta = self._gates(b, a)
        y, memories = delta_rule_states(q, k, v, g, beta, memory[0], counts)
        return y.reshape(qkv.shape[0], -1), (conv_states, memories)

    def step(self, xs: Inputs, state: State) -> tuple[torch.Tensor, State]:
        """One token per request: the conv window and the delta rule's recurrence."""
        qkv, b, a = xs
        conv_state, memory = state
        mixed, conv_after = causal_conv1d_decode(qkv, conv_state, self.conv1d.weight[:, 0], None)
        q, k, v = self._heads(mixed)
        g, beta = self._gates(b, a)
        y, memory_after = delta_rule_decode(q, k, v, g, beta, memory)
        return y.reshape(qkv.shape[0], -1), (conv_after, memory_after)

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output ``[T, conv_dim]`` -> unit-length q, k ``[T, Hv, Dk]`` (float32, each
        key head repeated for its value heads) and v ``[T, Hv, Dv]``."""
        shape = self.shape
        q, k, v = torch.split(mixed, [shape.key_dim, shape.key_dim, shape.value_dim], dim=-1)
        ratio = shape.num_value_heads // shape.num_key_heads

        def unit(x: torch.Tensor) -> torch.Tensor:
            x = x.reshape(-1, shape.num_key_heads, shape.key_head_dim).float()
            x = x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
            return x.repeat_interleave(ratio, dim=1) if ratio > 1 else x

        return unit(q), unit(k), v.reshape(-1, shape.num_value_heads, shape.value_head_dim)

    def _gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's log decay ``g`` per value head (``[T, H]``; per key channel,
        ``[T, H, Dk]``, in Kimi Delta Attention) and write rate ``beta`` per value head."""
        heads, bound = self.A_log.shape[0], self.shape.decay_bound
        a = (a.float() + self.dt_bias).view(a.shape[0], heads, -1)
        speed = self.A_log.float().exp()[:, None]
        g = bound * torch.sigmoid(speed * a) if bound is not None else -speed * F.softplus(a)
        g = g if self.shape.kda else g[..., 0]
        rate = b.sigmoid()
        return g, rate * self.shape.rate_scale if self.shape.rate_scale != 1.0 else rate
