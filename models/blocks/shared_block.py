"""Zamba2's shared attention blocks: one block's weights serve several layers, each use
with its own KV cache (the layer's attention spec) and its own low-rank adapters.

A layer that runs a block (``residual="shared_block"``, ``models/shapes/decoder.py``)::

    t = linear(block(cat(x, e)));   out = x + mamba(norm(x + t))
    block(y) = mlp(norm(attention(norm(y))))

The block is registered under the layer's ``shared_transformer``, as in the checkpoint;
the checkpoint holds it under its first use only, and the loader reads it for the later
uses too (``Family.shared_weights``). Each use reads its own adapter of the block's
lists (``linear_q_adapter_list.{use}``, ...).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridkv.models.blocks.attention import LayerInputs, PagedAttention
from hybridkv.models.blocks.mamba2 import Mamba2Mixer
from hybridkv.models.blocks.mlp import GatedMLP
from hybridkv.models.blocks.norms import config_norm
from hybridkv.models.config import ModelConfig
from hybridkv.models.weights.cuts import TensorCut, held_run, rows_of


def _adapter(width: int, rank: int, out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, rank, bias=False), nn.Linear(rank, out, bias=False))


def _own_adapters(state_dict: dict[str, Any], prefix: str, lists: list[str], use: int) -> None:
    """Read each of ``lists``' entry ``use`` as the module's own adapter (``..._list.{use}.``
    as ``...``); the other uses' entries are left out."""
    for name in lists:
        own, others = f"{prefix}{name}_list.{use}.", f"{prefix}{name}_list."
        for key in [k for k in state_dict if k.startswith(others)]:
            tensor = state_dict.pop(key)
            if key.startswith(own):
                state_dict[f"{prefix}{name}.{key[len(own) :]}"] = tensor


def _adapter_rows(adapter: nn.Module, rows: torch.Tensor | slice) -> None:
    """Keep the rows ``rows`` of the adapter's output (tensor parallelism)."""
    assert isinstance(adapter, nn.Sequential)
    adapter[1] = rows_of(adapter[1], rows)


class AdaptedAttention(PagedAttention):
    """Paged attention whose q, k and v each add a low-rank adapter of the same input
    (``rank`` None: none)."""

    def __init__(self, config: ModelConfig, layer: int, use: int, rank: int | None) -> None:
        super().__init__(config, layer)
        self._use = use
        names = ("linear_q_adapter", "linear_k_adapter", "linear_v_adapter")
        self.adapters: tuple[str, ...] = () if rank is None else names
        if rank is not None:
            width = self.q_proj.in_features
            widths = (self.q_proj.out_features, self.k_proj.out_features)
            for name, out in zip(names, (*widths, widths[1]), strict=True):
                self.add_module(name, _adapter(width, rank, out))

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        _own_adapters(state_dict, prefix, list(self.adapters), self._use)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        qk, v = super().project(x)
        if not self.adapters:
            return qk, v
        q, k, v_delta = (getattr(self, name)(x) for name in self.adapters)
        assert v is not None, "a shared block computes its values"
        return qk + torch.cat((q, k), dim=-1), v + v_delta

    def shard(self, cut: TensorCut) -> None:
        """The attention's share, and its adapters' rows of the rank's heads."""
        dim, heads = self.head_dim, self.num_heads // cut.size
        first_kv, num_kv = held_run(self.num_kv_heads, cut.size, cut.rank)
        super().shard(cut)
        if self.adapters:
            q = slice(cut.rank * heads * dim, (cut.rank + 1) * heads * dim)
            kv = slice(first_kv * dim, (first_kv + num_kv) * dim)
            for name, rows in zip(self.adapters, (q, kv, kv), strict=True):
                _adapter_rows(getattr(self, name), rows)


class AdaptedMLP(GatedMLP):
    """The gated MLP with a low-rank adapter added to its gate and up projections (gate
    rows first, as ``gate_up_proj``)."""

    def __init__(self, config: ModelConfig, use: int, rank: int) -> None:
        super().__init__(config, bias=config.mlp_bias)
        self._use = use
        inner = self.down_proj.in_features
        self.gate_up_proj_adapter = _adapter(config.hidden_size, rank, 2 * inner)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        _own_adapters(state_dict, prefix, ["gate_up_proj_adapter"], self._use)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def shard(self, cut: TensorCut) -> None:
        """The MLP's share, and its adapter's rows of the rank's run of gate and up."""
        inner = self.down_proj.in_features
        super().shard(cut)
        width = inner // cut.size
        held = torch.arange(cut.rank * width, (cut.rank + 1) * width)
        _adapter_rows(self.gate_up_proj_adapter, torch.cat((held, inner + held)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate_up = torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)
        else:
            gate_up = self.gate_up_proj(x)
        gate, up = (gate_up + self.gate_up_proj_adapter(x)).chunk(2, dim=-1)
        out: torch.Tensor = self.down_proj(self.act(gate) * up)
        return out


class SharedBlock(nn.Module):
    """``mlp(norm(attention(norm(y))))`` over ``y``, the hidden states beside the token
    embeddings, with this use's adapters."""

    def __init__(self, config: ModelConfig, layer: int, use: int) -> None:
        super().__init__()
        assert config.shared_blocks is not None and config.attention_input_width is not None
        blocks = config.shared_blocks
        rank = blocks.adapter_rank
        self.input_layernorm = config_norm(config, config.attention_input_width)
        self.self_attn = AdaptedAttention(
            config, layer, use, rank if blocks.attention_adapters else None
        )
        self.pre_ff_layernorm = config_norm(config, config.hidden_size)
        self.feed_forward = AdaptedMLP(config, use, rank)

    def forward(self, y: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(y), inputs)
        out: torch.Tensor = self.feed_forward(self.pre_ff_layernorm(attended))
        return out


class SharedBlockLayer(nn.Module):
    """A layer that runs a shared block, then its Mamba2 (``inputs.beside``'s state) over
    its input plus the block's projected output."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        assert config.shared_blocks is not None and config.mamba is not None
        use = config.shared_blocks.uses.index(layer)
        size = config.hidden_size
        self.shared_transformer = SharedBlock(config, layer, use)
        self.linear = nn.Linear(size, size, bias=False)
        self.input_layernorm = config_norm(config, size)
        self.mamba = Mamba2Mixer(config.mamba, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        assert inputs.embeddings is not None and inputs.beside is not None
        block = self.shared_transformer(torch.cat((hidden, inputs.embeddings), dim=-1), inputs)
        mixed = self.input_layernorm(hidden + self.linear(block))
        out: torch.Tensor = hidden + self.mamba(mixed, inputs.beside)
        return out
