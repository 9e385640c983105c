"""Linear layers whose weights are stored in 8 or 4 bits and multiplied by torch's own
weight-only CPU kernels.

    Int8Linear   w ~ q * scale            q int8 [N, K] (stored zero-padded to a multiple
                                          of 16 inputs), one float scale per output row
    Int4Linear   w ~ (q - 8) * s + z      q 4-bit [N, K], (s, z) per row and group of 32
                                          inputs, packed as ``_weight_int4pack_mm_for_cpu``
                                          reads it, and two levels a byte in row order

torch packs int4 weights for its kernel in a layout that depends on the CPU (blocks of
32 output rows with AVX2, of 64 with AVX-512, the rows of a last partial block paired
otherwise), so the many-rows path and joining layers (``fused_linear.py``) read the
levels from the row-order copy, never from the kernel's packing.

A few rows (decode: one per request) go through ``aten._weight_int8pack_mm`` /
``aten._weight_int4pack_mm_for_cpu``, which read the small weights directly; the kernels
take bfloat16 activations (their float32 path is a slow reference loop), so the input is
cast to bfloat16 and the output back. Many rows (a prefill chunk) are compute-bound: the
weights are expanded a slice of output rows at a time and go through the ordinary matmul,
never holding a whole float copy of a large matrix; in bfloat16 where the CPU has native
bfloat16 products (``cpu_features.py``), in the activation dtype elsewhere.

The int8 kernel reads K in whole vector widths with no tail, so its weight is stored
zero-padded to a multiple of 16 inputs and a few-rows input padded alike (below).
"""

from __future__ import annotations

import abc
from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.models.weights.cpu_features import has_native_bfloat16

#: Rows from which dequantising and an ordinary matmul beat the weight-only kernels.
DEQUANT_ROWS = 32
#: Inputs per int4 scale/zero pair (llama.cpp's Q4 sub-blocks are 32 too).
INT4_GROUP = 32
#: The int4 kernel packs output rows in multiples of this (blocks of 32 or 64 by CPU).
_INT4_ROWS = 32
#: Output rows expanded at a time on the many-rows path (bounds the float copy).
_SLICE_ROWS = 8192
#: ``aten._weight_int8pack_mm`` (torch 2.13 on CPU) reads K 16 inputs at a time with
#: AVX-512 and 8 with AVX2, with no loop for a remainder: any other K reads past the
#: rows, and one row returns inf or NaN while a few crash the process. Found on 2.13.0;
#: ``tests/models/weights/test_kernel_shapes.py`` sweeps K mod 16 in a child process.
_INT8_K_MULTIPLE = 16


class QuantizedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored quantized; subclasses pack and expand it."""

    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if rows.shape[0] < DEQUANT_ROWS:
            out = self.matmul_bf16(rows.to(torch.bfloat16)).to(x.dtype)
        else:
            # bfloat16 where the CPU multiplies it natively, as the few-rows kernels do
            # anyway: a long prefill chunk's product is faster than in float32
            # (benchmarks/decode/weight_quality.py --chunk, docs/benchmarks.md).
            dtype = torch.bfloat16 if has_native_bfloat16() else x.dtype
            rows = rows.to(dtype)
            stops = range(_SLICE_ROWS, self.out_features + _SLICE_ROWS, _SLICE_ROWS)
            slices = [(stop - _SLICE_ROWS, min(stop, self.out_features)) for stop in stops]
            parts = [rows @ self.expand(a, b, dtype).T for a, b in slices]
            out = torch.cat(parts, dim=-1).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    @abc.abstractmethod
    def matmul_bf16(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows @ W^T`` by the weight-only kernel, bfloat16 in and out."""

    @abc.abstractmethod
    def expand(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Output rows ``start .. stop-1`` of ``W`` as ``dtype`` ``[stop - start, K]``."""

    @classmethod
    @abc.abstractmethod
    def cat_rows(cls, parts: list[Self], bias: torch.Tensor | None) -> Self:
        """One layer whose output rows are those of ``parts`` in order (one input
        width), from their stored form: no weight is quantised again."""

    @abc.abstractmethod
    def take_rows(self, rows: torch.Tensor | slice) -> Self:
        """Output rows ``rows`` (and their bias), from the stored form: a tensor-parallel
        rank's share of a column-split layer, quantised as the whole layer was."""

    @abc.abstractmethod
    def take_columns(self, columns: slice) -> Self:
        """Input columns ``columns``, without the bias (a row-split layer's share, summed
        over ranks), from the stored form: each row keeps the whole row's scales, so the
        shares sum to what the whole layer computes."""

    def weight_bytes(self) -> int:
        """Bytes of weights (and their scales) one decode pass reads."""
        return sum(t.numel() * t.element_size() for t in self.kernel_buffers())

    @abc.abstractmethod
    def kernel_buffers(self) -> tuple[torch.Tensor, ...]:
        """The buffers the weight-only kernel reads."""

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int8Linear(QuantizedLinear):
    """Symmetric int8 weights with one scale per output row; ``qweight`` is ``[N, K']``,
    ``K`` inputs and zero columns up to the kernel's multiple of 16."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, bias)
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
        qweight = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        # bfloat16 scales, as the kernel takes them; the many-rows path expands with them.
        self._store(qweight, scales.to(torch.bfloat16))

    def _store(self, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        """Keep levels ``[N, K]`` (or already padded) zero-padded to ``[N, K']``, K' the
        next multiple of 16 (the kernel's shape limit above): padded inputs add zero."""
        width = -(-self.in_features // _INT8_K_MULTIPLE) * _INT8_K_MULTIPLE
        if qweight.shape[1] != width:
            qweight = F.pad(qweight, (0, width - qweight.shape[1]))
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.contiguous())

    def matmul_bf16(self, rows: torch.Tensor) -> torch.Tensor:
        padding = self.qweight.shape[1] - self.in_features
        rows = F.pad(rows, (0, padding)) if padding else rows.contiguous()
        out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)
        return out

    def levels(self, rows: torch.Tensor | slice) -> torch.Tensor:
        """int8 levels of output rows ``rows``, ``[..., K]`` (without the padding)."""
        return self.qweight[rows][..., : self.in_features]

    def expand(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        scales = self.scales[start:stop, None]
        levels = self.levels(slice(start, stop))
        if dtype == scales.dtype:
            # Levels are exact in bfloat16 and the product rounds once, as through float32:
            # the same values at a third of the memory traffic (benchmarks/decode/lm_head.py).
            return levels.to(dtype) * scales
        return (levels.to(torch.float32) * scales.float()).to(dtype)

    def kernel_buffers(self) -> tuple[torch.Tensor, ...]:
        return (self.qweight, self.scales)

    def take_rows(self, rows: torch.Tensor | slice) -> Int8Linear:
        bias = None if self.bias is None else self.bias[rows]
        return self._of(self.in_features, self.qweight[rows], self.scales[rows], bias)

    def take_columns(self, columns: slice) -> Int8Linear:
        qweight = self.qweight[:, : self.in_features][:, columns]
        return self._of(qweight.shape[1], qweight, self.scales, None)

    @classmethod
    def _of(
        cls,
        in_features: int,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> Int8Linear:
        out = cls.__new__(cls)
        QuantizedLinear.__init__(out, in_features, qweight.shape[0], bias)
        out._store(qweight, scales)
        return out

    @classmethod
    def cat_rows(cls, parts: list[Int8Linear], bias: torch.Tensor | None) -> Int8Linear:
        qweight = torch.cat([p.qweight for p in parts])
        scales = torch.cat([p.scales for p in parts])
        return cls._of(parts[0].in_features, qweight, scales, bias)


class Int4Linear(QuantizedLinear):
    """Asymmetric 4-bit weights, a bfloat16 (scale, zero) per row and group of inputs."""

    packed: torch.Tensor | None
    levels: torch.Tensor
    scales_zeros: torch.Tensor

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        steps: torch.Tensor | None = None,
    ) -> None:
        """Min-max scales per group, or the given grid ``steps`` per group (a weight
        already on a 4-bit grid, see ``models/weights/grid.py``: packed losslessly)."""
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
        pairs = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
        self._store(q.reshape(out_features, in_features), pairs.to(torch.bfloat16))

    def _store(self, q: torch.Tensor, scales_zeros: torch.Tensor) -> None:
        """Keep levels ``q`` ``[N, K]`` (0..15) in both layouts, and their scales; a
        share of rows the kernel cannot pack (a tensor-parallel cut) keeps the row-order
        levels alone and always expands them."""
        q = q.to(torch.uint8)
        self.register_buffer("levels", q[:, 0::2] | (q[:, 1::2] << 4))
        packed = None
        if fits_int4(*q.shape):
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros.contiguous())

    def matmul_bf16(self, rows: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return rows @ self.expand(0, self.out_features, torch.bfloat16).T
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, self.packed, INT4_GROUP, self.scales_zeros
        )
        return out

    def take_rows(self, rows: torch.Tensor | slice) -> Int4Linear:
        bias = None if self.bias is None else self.bias[rows]
        return self._of(self.levels[rows], self.scales_zeros[:, rows], bias)

    def take_columns(self, columns: slice) -> Int4Linear:
        start, stop, step = columns.indices(self.in_features)
        if step != 1 or start % INT4_GROUP or stop % INT4_GROUP:
            raise ValueError(
                f"int4 columns are cut on groups of {INT4_GROUP} inputs, not {start}..{stop}"
            )
        levels = self.levels[:, start // 2 : stop // 2]
        groups = self.scales_zeros[start // INT4_GROUP : stop // INT4_GROUP]
        return self._of(levels, groups, None)

    @classmethod
    def _of(
        cls, levels: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None
    ) -> Int4Linear:
        out = cls.__new__(cls)
        QuantizedLinear.__init__(out, levels.shape[1] * 2, levels.shape[0], bias)
        q = torch.stack([levels & 15, levels >> 4], dim=-1).flatten(-2)
        out._store(q, scales_zeros)
        return out

    def expand(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        return unpack_int4(self.levels[start:stop], self.scales_zeros[:, start:stop]).to(dtype)

    def kernel_buffers(self) -> tuple[torch.Tensor, ...]:
        if self.packed is None:
            return (self.levels, self.scales_zeros)
        return (self.packed, self.scales_zeros)

    @classmethod
    def cat_rows(cls, parts: list[Int4Linear], bias: torch.Tensor | None) -> Int4Linear:
        levels = torch.cat([p.levels for p in parts])
        return cls._of(levels, torch.cat([p.scales_zeros for p in parts], dim=1), bias)


def fits_int4(out_features: int, in_features: int) -> bool:
    """Whether a weight ``[out_features, in_features]`` packs for the int4 kernel.

    The guard of the int4 kernel's shapes (torch 2.13): its packing refuses N not a
    multiple of 16 and its groups need K a multiple of 32; both are asked of whole
    blocks of 32 rows, the packing's unit on AVX2 (``test_kernel_shapes.py`` sweeps them).
    """
    return out_features % _INT4_ROWS == 0 and in_features % INT4_GROUP == 0


def unpack_int4(levels: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """float32 weights ``[N, K]`` from levels two a byte (``levels[n, k // 2]``: the low
    nibble is input ``k`` when even, the high one when odd) and ``[K / 32, N, 2]`` bfloat16
    (scale, zero) pairs: ``(q - 8) * scale + zero``, as the kernel computes."""
    q = torch.stack([levels & 15, levels >> 4], dim=-1).flatten(-2).to(torch.float32)
    scales = scales_zeros[..., 0].T.float().repeat_interleave(INT4_GROUP, dim=1)
    zeros = scales_zeros[..., 1].T.float().repeat_interleave(INT4_GROUP, dim=1)
    return (q - 8.0) * scales + zeros


def linear_weight_bytes(module: nn.Module) -> int:
    """Bytes of weight a pass through ``module`` reads (a float or quantized linear)."""
    weight_bytes = getattr(module, "weight_bytes", None)
    if weight_bytes is not None:  # a quantised layer, or a head wrapping one
        return int(weight_bytes())
    assert isinstance(module, nn.Linear)
    weight = module.weight
    return weight.numel() * weight.element_size()
