"""MXFP4 checkpoints (gpt-oss's experts): each group of 32 weights is 32 four-bit floats
(E2M1: sign, two exponent bits, one mantissa bit) packed two to a byte, low nibble first,
and one shared power-of-two scale (E8M0: a byte, 127 for 2^0). ``X_blocks``
``[..., rows, groups, 16]`` and ``X_scales`` ``[..., rows, groups]`` hold tensor ``X`` of
``[..., rows, groups * 32]``, stored transposed: the checkpoint's float tensor is its
last two dimensions swapped (as transformers reads it). Dequantised at load, into the
model's dtype, before anything else sees the weights.
"""

from __future__ import annotations

import torch

#: The 16 values of an E2M1 nibble.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_BLOCKS, _SCALES = "_blocks", "_scales"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float tensor ``blocks`` and ``scales`` hold (see the module), in ``dtype``.

    Raises:
        ValueError: shapes that do not pair.
    """
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair"
        )
    table = torch.tensor(_E2M1, dtype=torch.float32, device=blocks.device)
    packed = blocks.to(torch.uint8)
    values = torch.stack((table[(packed & 0x0F).int()], table[(packed >> 4).int()]), dim=-1)
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values.flatten(-2), exponents[..., None])  # [..., rows, groups, 32]
    return values.flatten(-2).transpose(-1, -2).to(dtype).contiguous()


def dequantize_all(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``weights`` with every ``X_blocks`` and ``X_scales`` pair replaced by ``X``.

    Raises:
        ValueError: a blocks tensor without its scales, or the reverse.
    """
    stems = {name[: -len(_BLOCKS)] for name in weights if name.endswith(_BLOCKS)}
    scaled = {name[: -len(_SCALES)] for name in weights if name.endswith(_SCALES)}
    if stems != scaled:
        raise ValueError(f"MXFP4 tensors without their pair: {sorted(stems ^ scaled)[:4]}")
    out = {k: v for k, v in weights.items() if not k.endswith((_BLOCKS, _SCALES))}
    for stem in sorted(stems):
        out[stem] = dequantize(weights[f"{stem}{_BLOCKS}"], weights[f"{stem}{_SCALES}"], dtype)
    return out
