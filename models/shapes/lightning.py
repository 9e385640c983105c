"""Lightning attention's shape (MiniMax's ``linear_attention`` layers), read from
config.json (torch-free; ``hybridkv.models.blocks.lightning`` builds the mixer): per request
and layer, one ``head_dim x head_dim`` memory per head, float32, decayed by a constant rate
per head at every token."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from hybridkv.models.hf_config import int_field
from hybridkv.models.shapes.mamba2 import STATE_DTYPE_BYTES


@attrs.frozen(kw_only=True)
class LightningShape:
    """A lightning attention mixer: ``num_heads`` heads of ``head_dim`` over
    ``hidden_size``, in a model of ``num_layers`` layers (each layer's decay rates depend
    on its depth)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    num_layers: int

    @property
    def parts(self) -> tuple[tuple[int, ...], ...]:
        """The shapes of a state's parts: the memory of each head (values x keys)."""
        return ((self.num_heads, self.head_dim, self.head_dim),)

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's state in one layer."""
        return STATE_DTYPE_BYTES * sum(math.prod(part) for part in self.parts)

    def tensor_share(self, size: int) -> LightningShape:
        """What each of ``size`` tensor-parallel ranks holds: a run of the heads."""
        return attrs.evolve(self, num_heads=self.num_heads // size)


def lightning_shape(cfg: Mapping[str, Any]) -> LightningShape:
    """The lightning attention of a MiniMax config (its heads are the attention's)."""
    hidden, heads = int_field(cfg, "hidden_size"), int_field(cfg, "num_attention_heads")
    return LightningShape(
        hidden_size=hidden,
        num_heads=heads,
        head_dim=int_field(cfg, "head_dim", hidden // heads),
        num_layers=int_field(cfg, "num_hidden_layers"),
    )
