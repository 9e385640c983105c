"""Rotary position embeddings: one frequency table per rope spec, applied to q and k.

The cos/sin tables are computed once per step per spec (``models/shapes/rope.py`` parses
the specs, one per layer type, and says how each scaling rotates).
"""

from __future__ import annotations

import math

import torch

from hybridkv.models.shapes.rope import QueryTemperature, RopeSpec


def inv_freq(spec: RopeSpec, dim: int) -> torch.Tensor:
    """``spec``'s inverse frequencies over ``dim`` rotated channels, float32, ``dim // 2``
    of them (``longrope``: its short ones; ``dynamic``: inside ``max_position_embeddings``)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv = 1.0 / (spec.theta**exponents)
    if spec.rope_type == "linear":
        return inv / spec.factor
    if spec.rope_type == "llama3":
        return _llama3(spec, inv)
    if spec.rope_type == "yarn":
        return _yarn(spec, inv, dim)
    if spec.rope_type == "longrope":
        return inv / torch.tensor(spec.short_factor, dtype=torch.float32)
    if spec.rope_type == "proportional":  # over the whole head, the pairs past the share still
        inv[int(spec.partial_rotary_factor * dim // 2) :] = 0.0
        return inv / spec.factor
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


def _yarn(spec: RopeSpec, inv: torch.Tensor, dim: int) -> torch.Tensor:
    # Channels turning more than beta_fast times over the pretraining context keep their
    # frequency, those turning fewer than beta_slow times are divided by `factor`, and the
    # band between is ramped linearly (YaRN, arXiv 2309.00071, section 3.2).
    def channel(rotations: float) -> float:
        turns = spec.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(spec.theta))

    low, high = channel(spec.beta_fast), channel(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv / spec.factor * ramp + inv * (1 - ramp)


class RotaryTable:
    """cos/sin for given positions from one spec, kept on the model's device."""

    def __init__(self, spec: RopeSpec, head_dim: int, device: torch.device | str) -> None:
        self.spec = spec
        whole = spec.rope_type == "proportional"  # its share is of the frequencies
        self.rotary_dim = head_dim if whole else int(head_dim * spec.partial_rotary_factor)
        self.inv_freq = inv_freq(spec, self.rotary_dim).to(device)
        # longrope beyond the pretraining context: the long factors.
        self.long_inv_freq: torch.Tensor | None = None
        if spec.rope_type == "longrope":
            plain = inv_freq(RopeSpec(theta=spec.theta), self.rotary_dim)
            long = torch.tensor(spec.long_factor, dtype=torch.float32)
            self.long_inv_freq = (plain / long).to(device)

    def _freqs(self, positions: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, rotary_dim // 2]`` angles, each position by its own frequencies."""
        p = positions.to(torch.float32)[:, None]
        spec = self.spec
        if self.long_inv_freq is not None:
            beyond = positions[:, None] >= spec.original_max_position_embeddings
            return p * torch.where(beyond, self.long_inv_freq, self.inv_freq)
        if spec.rope_type == "dynamic" and self.rotary_dim > 2:
            # NTK: position p rotates as in a sequence of max(p + 1, context) tokens.
            context = spec.max_position_embeddings
            length = (p + 1).clamp(min=context)
            stretch = (spec.factor * length / context - (spec.factor - 1)) ** (
                self.rotary_dim / (self.rotary_dim - 2)
            )
            exponents = torch.arange(0, self.rotary_dim, 2, device=p.device) / self.rotary_dim
            return p / (spec.theta * stretch) ** exponents.to(torch.float32)
        return p * self.inv_freq[None, :]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``(cos, signed_sin)`` tables ``[num_tokens, 1, rotary_dim]`` in ``dtype``, to
        broadcast on heads, as :func:`apply_rope` takes them: the sines of the first half
        negated (both multiplied by the spec's ``attention_factor``)."""
        freqs = self._freqs(positions)
        sin, cos = freqs.sin(), freqs.cos()
        if self.spec.attention_factor != 1.0:
            sin, cos = sin * self.spec.attention_factor, cos * self.spec.attention_factor
        cos = cos.repeat(1, 2)[:, None, :]
        return cos.to(dtype), torch.cat((-sin, sin), dim=-1)[:, None, :].to(dtype)


def query_scales(temperature: QueryTemperature, positions: torch.Tensor) -> torch.Tensor:
    """``[num_tokens, 1, 1]`` float32: each position's query multiplier."""
    steps = torch.floor((positions.to(torch.float32) + temperature.offset) / temperature.every)
    return (1 + temperature.beta * torch.log1p(steps))[:, None, None]


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
