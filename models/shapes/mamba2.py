"""The shapes of a Mamba2 layer's per-request state, read from config.json (torch-free).

A Mamba2 layer keeps, per request, the last ``K - 1`` inputs of its causal convolution
and the SSM state of every head, both in float32 whatever the model's dtype (the state
accumulates over the whole sequence)::

    conv_state  [conv_dim, K-1]     conv_dim = intermediate + 2 * groups * state_size
    ssm_state   [heads, head_dim, state_size]

One page of a mamba group holds both, conv first, for every layer of the group. The layer
specs (``hybridkv.models.specs``) size the pages from :meth:`Mamba2Shape.state_bytes`, and
the model reads the same value, so the planner and the layers agree on the layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from hybridkv.models.errors import ModelConfigError
from hybridkv.models.hf_config import int_field

#: Bytes of one state value: float32.
STATE_DTYPE_BYTES = 4


@attrs.frozen(kw_only=True)
class Mamba2Shape:
    """What a Mamba2 mixer's weights and state look like (``mamba_*`` fields of the config).

    Attributes:
        hidden_size: Width of the residual stream.
        intermediate_size: ``mamba_expand * hidden_size``, the width of x and of the gate.
        num_heads: SSM heads (``mamba_n_heads``).
        head_dim: Channels per head (``mamba_d_head``).
        num_groups: B/C groups, each shared by ``num_heads // num_groups`` heads.
        state_size: SSM state per channel (``mamba_d_state``).
        conv_kernel: Width K of the causal convolution (``mamba_d_conv``).
        chunk_size: Positions per SSD chunk of the scan (``mamba_chunk_size``).
        conv_bias: The convolution has a bias.
        proj_bias: The in and out projections have biases.
        dt_min: Lower clamp of the time step.
        dt_max: Upper clamp of the time step (inf: none).
        gate: How the gate ``z`` meets the scan's output ``y``: ``norm(y * silu(z))``
            (``gate_then_norm``: Mamba2's), ``norm(y) * silu(z)`` (``norm_then_gate``)
            or ``y * silu(z)`` with no norm (``gate_only``): Falcon-H1's
            ``mamba_rms_norm`` and ``mamba_norm_before_gate``.
        out_bias: The out projection has a bias (by default: as the in projection;
            Falcon-H1's ``projectors_bias``).
        norm_eps: The gated norm's epsilon where it is not the model's (Zamba2's 1e-5).
    """

    hidden_size: int
    intermediate_size: int
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    conv_bias: bool
    proj_bias: bool
    dt_min: float = 0.0
    dt_max: float = float("inf")
    gate: Literal["gate_then_norm", "norm_then_gate", "gate_only"] = "gate_then_norm"
    out_bias: bool = attrs.field(
        default=attrs.Factory(lambda self: self.proj_bias, takes_self=True)
    )
    norm_eps: float | None = None

    def tensor_share(self, size: int) -> Mamba2Shape:
        """The mixer as each of ``size`` tensor-parallel ranks holds it: its share of the
        heads and channels, its share of the B/C groups or, where there are fewer groups
        than ranks, the one its heads read (``Mamba2Mixer.shard``)."""
        return attrs.evolve(
            self,
            intermediate_size=self.intermediate_size // size,
            num_heads=self.num_heads // size,
            num_groups=max(1, self.num_groups // size),
        )

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, B and C."""
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    @property
    def conv_shape(self) -> tuple[int, int]:
        """``[conv_dim, K-1]``."""
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        """``[heads, head_dim, state_size]``."""
        return (self.num_heads, self.head_dim, self.state_size)

    @property
    def parts(self) -> tuple[tuple[int, ...], ...]:
        """The shapes of a state's parts, in page order: conv state, SSM state."""
        return (self.conv_shape, self.ssm_shape)

    @property
    def state_values(self) -> int:
        """float32 values of one request's state in one layer."""
        conv_dim, width = self.conv_shape
        heads, head_dim, size = self.ssm_shape
        return conv_dim * width + heads * head_dim * size

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's state in one layer."""
        return STATE_DTYPE_BYTES * self.state_values


def mamba2_shape(cfg: Mapping[str, Any]) -> Mamba2Shape:
    """The Mamba2 fields of a Bamba or Granite-4.0-H config, with transformers' defaults.

    Raises:
        ModelConfigError: a missing or bad field, or heads that do not tile the width.
    """
    hidden = int_field(cfg, "hidden_size")
    expanded = int_field(cfg, "mamba_expand", 2) * hidden
    intermediate = int_field(cfg, "mamba_intermediate_size", expanded)
    num_heads = int_field(cfg, "mamba_n_heads", 128)
    head_dim_field = cfg.get("mamba_d_head", "auto")
    head_dim = (
        intermediate // num_heads
        if head_dim_field in (None, "auto")
        else int_field(cfg, "mamba_d_head")
    )
    if head_dim * num_heads != intermediate:
        raise ModelConfigError(
            f"mamba_n_heads={num_heads} x mamba_d_head={head_dim} must equal the mixer's "
            f"width, {intermediate}"
        )
    num_groups = int_field(cfg, "mamba_n_groups", 1)
    if num_heads % num_groups:
        raise ModelConfigError(
            f"mamba_n_heads={num_heads} is not a multiple of mamba_n_groups={num_groups}"
        )
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    return Mamba2Shape(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_heads=num_heads,
        head_dim=head_dim,
        num_groups=num_groups,
        state_size=int_field(cfg, "mamba_d_state", 256),
        conv_kernel=int_field(cfg, "mamba_d_conv", 4),
        chunk_size=int_field(cfg, "mamba_chunk_size", 256),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        dt_min=_limit(limit, 0),
        dt_max=_limit(limit, 1),
    )


def _limit(limit: Any, i: int) -> float:
    """One end of ``time_step_limit`` (JSON writes infinity as ``{"__float__": "Infinity"}``)."""
    try:
        value = limit[i]
        if isinstance(value, Mapping):
            value = value.get("__float__")
        return float(value)
    except (TypeError, ValueError, IndexError, KeyError):
        raise ModelConfigError(
            f"config field 'time_step_limit' must be two numbers, got {limit!r}"
        ) from None
