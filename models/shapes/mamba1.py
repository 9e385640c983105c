"""Mamba1's shape (Jamba's ``mamba``), read from config.json (torch-free;
``hybridkv.models.blocks.mamba1`` builds the mixer): per request and layer the causal
convolution's last ``K - 1`` inputs and a ``[channels, state]`` SSM state, float32."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from hybridkv.models.hf_config import flag_field, int_field
from hybridkv.models.shapes.mamba2 import STATE_DTYPE_BYTES


@attrs.frozen(kw_only=True)
class Mamba1Shape:
    """A Mamba1 mixer: ``channels`` (``mamba_expand * hidden``) of ``state_size`` states,
    a convolution of ``conv_kernel`` taps, time steps of rank ``dt_rank``; the time step,
    B and C RMS-normalised before use with weights (``weighted``: Jamba's), without
    (``weightless``: Falcon-Mamba's, at ``selection_eps``) or not (``none``: Mamba's)."""

    hidden_size: int
    channels: int
    state_size: int
    conv_kernel: int
    dt_rank: int
    conv_bias: bool = True
    proj_bias: bool = False
    selection_norm: Literal["weighted", "weightless", "none"] = "weighted"
    selection_eps: float | None = None

    @property
    def parts(self) -> tuple[tuple[int, ...], ...]:
        """The shapes of a state's parts, in page order: conv state, SSM state."""
        return ((self.channels, self.conv_kernel - 1), (self.channels, self.state_size))

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's state in one layer."""
        return STATE_DTYPE_BYTES * sum(math.prod(part) for part in self.parts)

    def tensor_share(self, size: int) -> Mamba1Shape:
        """What each of ``size`` tensor-parallel ranks holds: a run of the channels (the
        time step's rank and B/C's states whole)."""
        return attrs.evolve(self, channels=self.channels // size)


def mamba1_shape(cfg: Mapping[str, Any]) -> Mamba1Shape:
    """The Mamba1 fields of a Jamba config, with transformers' defaults (Mamba's and
    Falcon-Mamba's under the same names: ``models/families/mamba.py``)."""
    hidden = int_field(cfg, "hidden_size")
    rank = cfg.get("mamba_dt_rank", "auto")
    return Mamba1Shape(
        hidden_size=hidden,
        channels=int_field(cfg, "mamba_expand", 2) * hidden,
        state_size=int_field(cfg, "mamba_d_state", 16),
        conv_kernel=int_field(cfg, "mamba_d_conv", 4),
        dt_rank=math.ceil(hidden / 16)
        if rank in (None, "auto")
        else int_field(cfg, "mamba_dt_rank"),
        conv_bias=flag_field(cfg, "mamba_conv_bias", True),
        proj_bias=flag_field(cfg, "mamba_proj_bias", False),
        selection_norm=cfg.get("mamba_selection_norm", "weighted"),
        selection_eps=cfg.get("mixer_rms_eps"),
    )
