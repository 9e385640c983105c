"""Linear layers whose weights are stored in 8 or 4 bits and multiplied by torch's own
weight-only CPU kernels.

    Int8Linear   w ~ q * scale            q int8 [N, K], one float scale per output row
    Int4Linear   w ~ (q - 8) * s + z      q 4-bit [N, K], (s, z) per row and group of 32
                                          inputs, packed as ``_weight_int4pack_mm_for_cpu``
                                          reads it

A few rows (decode: one per request) go through ``aten._weight_int8pack_mm`` /
``aten._weight_int4pack_mm_for_cpu``, which read the small weights directly; the kernels
take bfloat16 activations (their float32 path is a slow reference loop), so the input is
cast to bfloat16 and the output back. Many rows (a prefill chunk) are compute-bound: the
weights are expanded to the activation dtype a slice of output rows at a time and go
through the ordinary matmul, never holding a whole float copy of a large matrix.
"""

from __future__ import annotations

import abc

import torch
from torch import nn

#: Rows from which dequantising and an ordinary matmul beat the weight-only kernels.
DEQUANT_ROWS = 32
#: Inputs per int4 scale/zero pair (llama.cpp's Q4 sub-blocks are 32 too).
INT4_GROUP = 32
#: Output rows per block of the int4 kernel's packed layout.
_INT4_ROWS = 32
#: Output rows expanded at a time on the many-rows path (bounds the float copy).
_SLICE_ROWS = 8192


class QuantizedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored quantized; subclasses pack and expand it."""

    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] < DEQUANT_ROWS:
            out = self.matmul_bf16(rows.to(torch.bfloat16)).to(x.dtype)
        else:
            stops = range(_SLICE_ROWS, self.out_features + _SLICE_ROWS, _SLICE_ROWS)
            slices = [(stop - _SLICE_ROWS, min(stop, self.out_features)) for stop in stops]
            out = torch.cat([rows @ self.expand(a, b, x.dtype).T for a, b in slices], dim=-1)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    @abc.abstractmethod
    def matmul_bf16(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows @ W^T`` by the weight-only kernel, bfloat16 in and out."""

    @abc.abstractmethod
    def expand(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Output rows ``start .. stop-1`` of ``W`` as ``dtype`` ``[stop - start, K]``."""

    def weight_bytes(self) -> int:
        """Bytes of weights (and their scales) one full pass reads."""
        return sum(t.numel() * t.element_size() for t in self.buffers() if t is not self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int8Linear(QuantizedLinear):
    """Symmetric int8 weights with one scale per output row."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, bias)
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
        self.register_buffer(
            "qweight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        )
        # bfloat16, as the kernel takes them; the many-rows path expands with the same.
        self.register_buffer("scales", scales.to(torch.bfloat16))

    def matmul_bf16(self, rows: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)
        return out

    def expand(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        scales = self.scales[start:stop, None].float()
        return (self.qweight[start:stop].to(torch.float32) * scales).to(dtype)


class Int4Linear(QuantizedLinear):
    """Asymmetric 4-bit weights, a bfloat16 (scale, zero) per row and group of inputs."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        steps: torch.Tensor | None = None,
    ) -> None:
        """Min-max scales per group, or the given grid ``steps`` per group (a weight
        already on a 4-bit grid, see ``models/weight_grid.py``: packed losslessly)."""
        out_features, in_features = weight.shape
        if not fits_int4(out_features, in_features):
            raise ValueError(f"int4 needs N and K multiples of 32, got {tuple(weight.shape)}")
        super().__init__(in_features, out_features, bias)
        groups = weight.detach().float().reshape(out_features, -1, INT4_GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        if steps is None:
            scales = ((high - low) / 15.0).clamp(min=1e-8)
        else:
            scales = steps.reshape(low.shape)
        q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
        # The kernel computes (q - 8) * scale + zero.
        zeros = low + 8.0 * scales
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).reshape(out_features, in_features), 1
        )
        self.register_buffer("packed", packed)
        pairs = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_zeros", pairs.to(torch.bfloat16))

    def matmul_bf16(self, rows: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed, INT4_GROUP, self.scales_zeros
        )
        return out

    def expand(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return unpack_int4(self.packed[start:stop], self.scales_zeros[:, start:stop]).to(dtype)


def fits_int4(out_features: int, in_features: int) -> bool:
    """Whether a weight ``[out_features, in_features]`` packs for the int4 kernel."""
    return out_features % _INT4_ROWS == 0 and in_features % INT4_GROUP == 0


def unpack_int4(packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """float32 weights ``[N, K]`` from the int4 kernel's packing (N a multiple of 32).

    Packed layout, per block of 32 output rows and 4 inputs: 16 bytes whose low nibbles
    are rows 0-15 of the block and high nibbles rows 16-31::

        packed[b*32 + k//4, (k%4)*16 + r%16]  holds  q[b*32 + r, k]   (low: r < 16)
    """
    num_rows, half = packed.shape
    in_features = half * 2
    blocks = packed.reshape(num_rows // _INT4_ROWS, in_features // 4, 4, 16)
    nibbles = torch.stack([blocks & 15, blocks >> 4], dim=1)  # [b, hi, k4, kr, r16]
    q = nibbles.permute(0, 1, 4, 2, 3).reshape(num_rows, in_features).to(torch.float32)
    scales = scales_zeros[..., 0].T.float().repeat_interleave(INT4_GROUP, dim=1)
    zeros = scales_zeros[..., 1].T.float().repeat_interleave(INT4_GROUP, dim=1)
    return (q - 8.0) * scales + zeros


def linear_weight_bytes(module: nn.Module) -> int:
    """Bytes of weight a pass through ``module`` reads (a float or quantized linear)."""
    if isinstance(module, QuantizedLinear):
        return module.weight_bytes()
    assert isinstance(module, nn.Linear)
    weight = module.weight
    return weight.numel() * weight.element_size()
