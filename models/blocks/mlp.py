"""MLPs: the gated MLP (SwiGLU, GeGLU) with separate or joined gate and up projections,
the plain one (Nemotron-H's: no gate), and Granite's shared MLP (gate and up stacked in
one checkpoint tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.models.config import ModelConfig
from hybridkv.models.weights.cuts import (
    TensorCut,
    columns_of,
    gated_share,
    rows_of,
    summed_columns,
)
from hybridkv.models.weights.fused_linear import cat_linears, split_joined


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": _gelu_tanh,
    "gelu": F.gelu,
    "relu2": _relu2,
}


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with SiLU (Llama) or tanh-approximated GELU (Gemma).

    Loaded as ``gate_proj`` and ``up_proj`` (a checkpoint's joined ``gate_up_proj``, gate
    rows first, read as the two); :meth:`fuse` joins them into ``gate_up_proj``.
    """

    def __init__(self, config: ModelConfig, *, bias: bool, inner: int | None = None) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, inner or config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.gate_up_proj: nn.Module | None = None
        self.act = ACTIVATIONS[config.activation]
        self.limit = config.mlp_limit

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        inner = self.down_proj.in_features
        split_joined(state_dict, prefix, "gate_up_proj", [("gate_proj", inner), ("up_proj", inner)])
        super()._load_from_state_dict(state_dict, prefix, *args)

    def shard(self, cut: TensorCut) -> None:
        """Keep the rank's run of the width: rows of gate and up, columns of down
        (summed over the group)."""
        parts = gated_share(cut, self.gate_proj, self.up_proj, self.down_proj)
        for name, part in zip(("gate_proj", "up_proj", "down_proj"), parts, strict=True):
            self.set_submodule(name, part)

    def fuse(self) -> bool:
        """Join gate and up into one product (``models/weights/fused_linear.py``); False where
        their storage differs and they stay apart."""
        joined = cat_linears([self.gate_proj, self.up_proj])
        if joined is None:
            return False
        del self.gate_proj, self.up_proj
        self.gate_up_proj = joined
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.limit is not None:  # DeepSeek V4's clamps
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        out: torch.Tensor = self.down_proj(self.act(gate).mul_(up))
        return out


class PlainMLP(nn.Module):
    """``down(act(up(x)))``, no gate (Nemotron-H's MLP layers and shared experts, squared
    ReLU), ``inner`` wide (the config's MLP width by default)."""

    def __init__(self, config: ModelConfig, *, bias: bool, inner: int | None = None) -> None:
        super().__init__()
        inner = inner or config.intermediate_size
        self.up_proj = nn.Linear(config.hidden_size, inner, bias=bias)
        self.down_proj = nn.Linear(inner, config.hidden_size, bias=bias)
        self.act = ACTIVATIONS[config.activation]

    def shard(self, cut: TensorCut, *, summed: bool = True) -> None:
        """Keep the rank's run of the width: rows of up, columns of down, summed over
        the group unless the caller sums (``summed``: a mixture's shared expert)."""
        width = self.up_proj.out_features // cut.size
        held = torch.arange(cut.rank * width, (cut.rank + 1) * width)
        self.set_submodule("up_proj", rows_of(self.up_proj, held))
        down = self.down_proj
        self.set_submodule(
            "down_proj", summed_columns(cut, down, held) if summed else columns_of(down, held)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act(self.up_proj(x)))
        return out


class SharedMLP(nn.Module):
    """``output(silu(gate) * up)`` with gate and up from one stacked projection."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * inner, bias=False)
        self.output_linear = nn.Linear(inner, hidden, bias=False)

    def shard(self, cut: TensorCut) -> None:
        """Keep the rank's run of the width, in both halves of the stacked projection,
        and its columns of the output (summed over the group)."""
        width = self.input_linear.out_features // 2 // cut.size
        held = torch.arange(cut.rank * width, (cut.rank + 1) * width)
        rows = torch.cat((held, held + width * cut.size))
        self.set_submodule("input_linear", rows_of(self.input_linear, rows))
        self.set_submodule("output_linear", summed_columns(cut, self.output_linear, held))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        out: torch.Tensor = self.output_linear(F.silu(gate) * up)
        return out
