"""Rotary position embeddings: one frequency table per rope spec, applied to q and k.

A model may use different rope parameters per layer type (Gemma 3: a local base frequency
for sliding layers, the global one with linear scaling for full layers), so the spec is
parsed per layer type and the cos/sin tables are computed once per step per spec.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from hybridkv.models.errors import ModelConfigError

_SUPPORTED = ("default", "linear", "llama3")


@attrs.frozen(kw_only=True)
class RopeSpec:
    """Parameters of one rotary table.

    Attributes:
        theta: The base wavelength.
        rope_type: ``default``, ``linear`` (frequencies divided by ``factor``) or
            ``llama3`` (low frequencies divided by ``factor``, a smooth ramp between).
        factor: Scaling factor (``linear`` and ``llama3``).
        low_freq_factor: ``llama3`` only.
        high_freq_factor: ``llama3`` only.
        original_max_position_embeddings: ``llama3`` only: the pretraining context.
        partial_rotary_factor: The share of each head rotated (its first channels; Bamba
            rotates half); 0 rotates nothing (Granite 4.0-H without position embeddings).
    """

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_hf(
        cls, params: Mapping[str, Any] | None, *, theta: float, max_positions: int
    ) -> RopeSpec:
        """Parse a Hugging Face rope dict (``rope_parameters`` or legacy ``rope_scaling``).

        ``theta`` is used where the dict has no ``rope_theta``; a ``None`` dict means
        plain rope at ``theta``.

        Raises:
            ModelConfigError: a rope type we do not implement.
        """
        params = dict(params or {})
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        if rope_type not in _SUPPORTED:
            raise ModelConfigError(
                f"rope_type {rope_type!r} is not supported; supported: {', '.join(_SUPPORTED)}"
            )
        return cls(
            theta=float(params.get("rope_theta", theta)),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", max_positions)
            ),
            partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
        )

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """Inverse frequencies, float32, ``head_dim // 2`` of them."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        inv = 1.0 / (self.theta**exponents)
        if self.rope_type == "linear":
            return inv / self.factor
        if self.rope_type == "llama3":
            return self._llama3(inv)
        return inv

    def _llama3(self, inv: torch.Tensor) -> torch.Tensor:
        # Long wavelengths are slowed by `factor`, short ones kept, the band between ramped.
        context = self.original_max_position_embeddings
        low_wavelen = context / self.low_freq_factor
        high_wavelen = context / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = (context / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        ramped = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, ramped, scaled)


def rope_from_hf(hf: Mapping[str, Any], *, default_theta: float) -> RopeSpec:
    """The one rope spec of a config that shares it across layers (Llama, Gemma 2).

    Reads ``rope_parameters`` (transformers 5) or the legacy ``rope_theta`` and
    ``rope_scaling`` fields.
    """
    params = hf.get("rope_parameters") or hf.get("rope_scaling")
    return RopeSpec.from_hf(
        params,
        theta=float(hf.get("rope_theta") or default_theta),
        max_positions=int(hf.get("max_position_embeddings") or 2048),
    )


class RotaryTable:
    """cos/sin for given positions from one spec, kept on the model's device."""

    def __init__(self, spec: RopeSpec, head_dim: int, device: torch.device | str) -> None:
        self.spec = spec
        rotary_dim = int(head_dim * spec.partial_rotary_factor)
        self.inv_freq = spec.inv_freq(rotary_dim).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``(cos, signed_sin)`` tables ``[num_tokens, 1, rotary_dim]`` in ``dtype``, to
        broadcast on heads, as :func:`apply_rope` takes them: the sines of the first half
        negated."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        sin = freqs.sin()
        cos = freqs.cos().repeat(1, 2)[:, None, :]
        return cos.to(dtype), torch.cat((-sin, sin), dim=-1)[:, None, :].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[num_tokens, heads, head_dim]``) by half-split pairs.

    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = (-x2, x1)``, as
    ``x * cos + (x2, x1) * (-sin, sin)``: the half swap is one ``roll`` and the sign lives in
    the table (the same values in 4 ops instead of 7). Tables narrower than the head
    (partial rotary) rotate its first channels only.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        head, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((apply_rope(head, cos, signed_sin), rest), dim=-1)
    return x * cos + x.roll(rotary_dim // 2, dims=-1) * signed_sin
