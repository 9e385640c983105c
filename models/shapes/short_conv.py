"""LFM2's short convolution, read from config.json (torch-free;
``hybridkv.models.blocks.short_conv`` builds it): per request and layer, the last ``K - 1``
inputs of its ``hidden_size`` channels, float32."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hybridkv.models.hf_config import flag_field, int_field
from hybridkv.models.shapes.mamba2 import STATE_DTYPE_BYTES


@attrs.frozen(kw_only=True)
class ShortConvShape:
    """A short convolution: ``channels`` of ``kernel`` taps, biased or not."""

    channels: int
    kernel: int
    bias: bool = False

    @property
    def state_bytes(self) -> int:
        """Bytes of one request's state in one layer."""
        return STATE_DTYPE_BYTES * self.channels * (self.kernel - 1)

    @property
    def parts(self) -> tuple[tuple[int, ...], ...]:
        """The shapes of a state's parts: the conv state alone."""
        return ((self.channels, self.kernel - 1),)

    def tensor_share(self, size: int) -> ShortConvShape:
        """The share of channels one of ``size`` tensor-parallel ranks holds."""
        return attrs.evolve(self, channels=self.channels // size)


def short_conv_shape(cfg: Mapping[str, Any]) -> ShortConvShape:
    """The short convolution of an LFM2 config (``conv_L_cache`` taps, ``conv_bias``)."""
    return ShortConvShape(
        channels=int_field(cfg, "hidden_size"),
        kernel=int_field(cfg, "conv_L_cache", 3),
        bias=flag_field(cfg, "conv_bias", False),
    )
