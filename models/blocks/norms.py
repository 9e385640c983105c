"""Norms: RMSNorm (Llama's and Gemma's conventions), LayerNorm, and Mamba2's gated
RMSNorm (whole, or spread over tensor-parallel ranks).

Parameter names follow Hugging Face checkpoints (``weight``); every norm works on a flat
batch of tokens, ``[num_tokens, ...]``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.models.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled by ``offset + weight``.

    Gemma stores ``weight`` centred on zero (``offset=1``) and scales before casting back;
    Llama stores it centred on one (``offset=0``) and scales after casting back; OLMo
    centres it on one and scales before (``scale_first``; by default, where ``offset``).
    """

    def __init__(
        self, dim: int, eps: float, offset: float, scale_first: bool | None = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.offset = offset
        self.scale_first = bool(offset) if scale_first is None else scale_first
        self._scale: tuple[torch.Tensor, int, torch.Tensor] | None = None

    def scale(self) -> torch.Tensor:
        """What normalised values are multiplied by: ``weight + offset`` in float32 where
        there is an offset or the scale applies in float32 (``scale_first``), else
        ``weight``. Kept per weight: a decode step runs some 100 norms, and the sum was an
        op of each (and a bfloat16 weight beside float32 values takes torch's unfused
        norm)."""
        weight = self.weight
        if not (self.offset or self.scale_first):
            return weight
        kept = self._scale
        if kept is None or kept[0] is not weight or kept[1] != weight.data_ptr():
            kept = (weight, weight.data_ptr(), weight.detach().float() + self.offset)
            self._scale = kept
        return kept[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.scale(), self.eps, scale_first=self.scale_first)


def rms_norm(
    x: torch.Tensor, scale: torch.Tensor, eps: float, *, scale_first: bool
) -> torch.Tensor:
    """``x`` normalised over its last dimension in float32, times ``scale`` (broadcast on
    the last dimensions of ``x``), cast back to ``x``'s dtype after the product where
    ``scale_first`` (Gemma, OLMo), before it otherwise (Llama)."""
    dim = (x.shape[-1],)
    is_float = x.dtype == torch.float32
    if is_float or scale_first:
        # One fused float32 kernel where the scale is the last dimension's (fewer ops
        # than the unfused form, in float32 and bfloat16).
        fused = scale.shape == dim
        normed = F.rms_norm(x if is_float else x.float(), dim, scale if fused else None, eps)
        normed = normed if fused else normed * scale
        return normed if is_float else normed.to(x.dtype)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return scale * normed.to(x.dtype)


class WeightlessRMSNorm(nn.Module):
    """Root-mean-square norm in float32 without a weight, cast back (Falcon-Mamba's norms
    of its time step, B and C)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm without a bias, in float32, scaled by ``weight`` before casting back
    (Cohere's)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), None, self.eps)
        return normed.to(x.dtype)


def config_norm(config: ModelConfig, dim: int) -> nn.Module:
    """A norm of ``dim`` values by the model's conventions (kind, eps, offset, order)."""
    if config.norm_kind == "layer":
        return LayerNorm(dim, config.rms_norm_eps)
    return config_rms_norm(config, dim)


def config_rms_norm(config: ModelConfig, dim: int) -> RMSNorm:
    """An RMSNorm of ``dim`` values by the model's conventions (q/k norms are RMSNorms
    whatever the layers' norm)."""
    return RMSNorm(dim, config.rms_norm_eps, config.norm_offset, config.norm_scale_first)


class GatedRMSNorm(nn.Module):
    """RMSNorm of ``x * silu(gate)`` over groups of channels, in float32 (Mamba2's norm);
    with ``norm_first``, ``norm(x) * silu(gate)`` (Falcon-H1's ``mamba_norm_before_gate``).
    """

    def __init__(self, dim: int, group_size: int, eps: float, *, norm_first: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.group_size = group_size
        self.eps = eps
        self.norm_first = norm_first

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = _gated(x, gate, not self.norm_first)
        grouped = h.view(*h.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * grouped.view(h.shape).to(x.dtype)
        return _gated(out, gate, self.norm_first).to(x.dtype) if self.norm_first else out


def _gated(x: torch.Tensor, gate: torch.Tensor, gated: bool) -> torch.Tensor:
    """``x * silu(gate)`` in float32 where ``gated``, else ``x`` in float32."""
    return x.float() * F.silu(gate.float()) if gated else x.float()


class SpreadGatedRMSNorm(nn.Module):
    """Mamba2's gated norm on a tensor-parallel rank whose channels are part of a norm
    group spread over several ranks: each group's sum of squares is summed over the
    ranks (``reduce``) before it scales. Called without a gate (and ``norm_first``), an
    RMSNorm of Llama's convention spread over the ranks (lightning attention's output
    norm over every head).

    Args:
        weight: The rank's channels of the norm weight.
        group_index: The norm group its channels belong to, of ``num_groups``.
        group_size: Channels in a whole norm group.
        eps: The norm's epsilon.
        reduce: Sums a tensor over the tensor-parallel group, in place.
        norm_first: Gate after the norm (``GatedRMSNorm``'s).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        *,
        group_index: int,
        num_groups: int,
        group_size: int,
        eps: float,
        reduce: Callable[[torch.Tensor], None],
        norm_first: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.group_index, self.num_groups, self.group_size = group_index, num_groups, group_size
        self.eps = eps
        self.reduce = reduce
        self.norm_first = norm_first

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        assert gate is not None or self.norm_first, "a gate goes in before the norm"
        h = x.float() if gate is None else _gated(x, gate, not self.norm_first)
        sums = h.new_zeros(h.shape[0], self.num_groups)
        sums[:, self.group_index] = h.pow(2).sum(-1)
        self.reduce(sums)
        scale = torch.rsqrt(sums[:, self.group_index] / self.group_size + self.eps)
        out = self.weight * (h * scale[:, None]).to(x.dtype)
        if gate is None or not self.norm_first:
            return out
        return _gated(out, gate, True).to(x.dtype)


class NormThenGate(nn.Module):
    """RMSNorm over each head, scaled by ``weight`` in the input's dtype, then multiplied
    by ``silu(gate)`` in float32 (Gated DeltaNet's output norm; Mamba2's gates first), or
    with ``sigmoid``, in float32 throughout, by ``sigmoid(gate)`` (Kimi Delta Attention's)."""

    def __init__(self, dim: int, eps: float, *, sigmoid: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.sigmoid = sigmoid

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.sigmoid:
            return (self.weight.float() * normed * torch.sigmoid(gate.float())).to(x.dtype)
        return (self.weight * normed.to(x.dtype) * F.silu(gate.float())).to(x.dtype)
