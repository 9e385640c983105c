"""Gated DeltaNet's shape (Qwen3-Next, Qwen3.5) and Kimi Delta Attention's (Kimi Linear),
read from config.json (torch-free; ``hybridkv.models.blocks.deltanet`` builds the mixer).

Per request and layer the state is the causal convolution's last ``K - 1`` inputs of q, k
and v (``[conv_dim, K-1]``) and, per value head, a ``[key_head_dim, value_head_dim]``
memory, float32 whatever the model's dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hybridkv.models.errors import ModelConfigError
from hybridkv.models.hf_config import int_field
from hybridkv.models.shapes.mamba2 import STATE_DTYPE_BYTES


@attrs.frozen(kw_only=True)
class DeltaNetShape:
    """A Gated DeltaNet mixer.

    Attributes:
        hidden_size: Width of the residual stream.
        num_key_heads: Query and key heads (``linear_num_key_heads``).
        num_value_heads: Value heads, a multiple of the key heads: each key head serves
            ``num_value_heads // num_key_heads`` of them in a row.
        key_head_dim: Width of a query or key head.
        value_head_dim: Width of a value head.
        conv_kernel: Taps of the causal convolution over q, k and v.
        rate_scale: The write rate ``sigmoid(b)`` is multiplied by it (OLMo Hybrid's 2:
            negative eigenvalues allowed).
        norm_eps: The output norm's epsilon where it is not the model's (OLMo Hybrid's).
        kda: Kimi Delta Attention: the memory fades per key channel, and the output norm
            is gated by a sigmoid; Gated DeltaNet's fades per head and gates by a SiLU.
        gate_rank: The decay's and the output gate's projections pass through this width
            (Kimi Linear's ``f_a_proj``, ``f_b_proj``, ``g_a_proj``, ``g_b_proj``: the
            head width); 0: one projection each (Ling's ``f_proj``, ``g_proj``).
        decay_bound: The log decay is ``decay_bound * sigmoid(exp(A_log) * (a +
            dt_bias))``, bounded below (Ling's ``kda_safe_gate``); None:
            ``-exp(A_log) * softplus(a + dt_bias)``.
    """

    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    rate_scale: float = 1.0
    norm_eps: float | None = None
    kda: bool = False
    gate_rank: int = 0
    decay_bound: float | None = None

    @property
    def key_dim(self) -> int:
        """Channels of all query (or key) heads."""
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        """Channels of all value heads."""
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_shape(self) -> tuple[int, int]:
        """``[conv_dim, K-1]``."""
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def memory_shape(self) -> tuple[int, int, int]:
        """``[value heads, key_head_dim, value_head_dim]``."""
        return (self.num_value_heads, self.key_head_dim, self.value_head_dim)

    @property
    def parts(self) -> tuple[tuple[int, ...], ...]:
        """The shapes of a state's parts, in page order: conv state, memory."""
        return (self.conv_shape, self.memory_shape)

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's state in one layer."""
        conv, width = self.conv_shape
        heads, keys, values = self.memory_shape
        return STATE_DTYPE_BYTES * (conv * width + heads * keys * values)

    def tensor_share(self, size: int) -> DeltaNetShape:
        """The mixer as each of ``size`` tensor-parallel ranks holds it: its share of the
        key heads and of the value heads they serve."""
        return attrs.evolve(
            self,
            num_key_heads=self.num_key_heads // size,
            num_value_heads=self.num_value_heads // size,
        )


def deltanet_shape(cfg: Mapping[str, Any]) -> DeltaNetShape:
    """The Gated DeltaNet fields of a Qwen3-Next or Qwen3.5 config (transformers' defaults).

    Raises:
        ModelConfigError: a missing or bad field, or value heads that key heads do not tile.
    """
    shape = DeltaNetShape(
        hidden_size=int_field(cfg, "hidden_size"),
        num_key_heads=int_field(cfg, "linear_num_key_heads", 16),
        num_value_heads=int_field(cfg, "linear_num_value_heads", 32),
        key_head_dim=int_field(cfg, "linear_key_head_dim", 128),
        value_head_dim=int_field(cfg, "linear_value_head_dim", 128),
        conv_kernel=int_field(cfg, "linear_conv_kernel_dim", 4),
    )
    if shape.num_value_heads % shape.num_key_heads:
        raise ModelConfigError(
            f"linear_num_value_heads={shape.num_value_heads} is not a multiple of "
            f"linear_num_key_heads={shape.num_key_heads}"
        )
    return shape


def kda_shape(cfg: Mapping[str, Any]) -> DeltaNetShape:
    """The Kimi Delta Attention of a Kimi Linear config (normalized: ``linear_num_heads``
    heads of ``linear_head_dim`` for queries, keys and values alike)."""
    heads, width = int_field(cfg, "linear_num_heads"), int_field(cfg, "linear_head_dim")
    return DeltaNetShape(
        hidden_size=int_field(cfg, "hidden_size"),
        num_key_heads=heads,
        num_value_heads=heads,
        key_head_dim=width,
        value_head_dim=width,
        conv_kernel=int_field(cfg, "linear_conv_kernel_dim", 4),
        kda=True,
        gate_rank=width,
    )
