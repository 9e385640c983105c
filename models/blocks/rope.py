"""Rotary position embeddings: one frequency table per rope spec, applied to q and k.

The cos/sin tables are computed once per step per spec (``models/shapes/rope.py`` parses
the specs, one per layer type).
"""

from __future__ import annotations

import math

import torch

from hybridkv.models.shapes.rope import RopeSpec


def inv_freq(spec: RopeSpec, head_dim: int) -> torch.Tensor:
    """``spec``'s inverse frequencies, float32, ``head_dim // 2`` of them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv = 1.0 / (spec.theta**exponents)
    if spec.rope_type == "linear":
        return inv / spec.factor
    if spec.rope_type == "llama3":
        return _llama3(spec, inv)
    return inv


def _llama3(spec: RopeSpec, inv: torch.Tensor) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between ramped.
    context = spec.original_max_position_embeddings
    low_wavelen = context / spec.low_freq_factor
    high_wavelen = context / spec.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / spec.factor, inv)
    smooth = (context / wavelen - spec.low_freq_factor) / (
        spec.high_freq_factor - spec.low_freq_factor
    )
    ramped = (1 - smooth) * scaled / spec.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, ramped, scaled)


class RotaryTable:
    """cos/sin for given positions from one spec, kept on the model's device."""

    def __init__(self, spec: RopeSpec, head_dim: int, device: torch.device | str) -> None:
        self.spec = spec
        rotary_dim = int(head_dim * spec.partial_rotary_factor)
        self.inv_freq = inv_freq(spec, rotary_dim).to(device)

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
