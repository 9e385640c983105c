"""Joining projections that read the same input: same outputs, one product."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridkv.models.weights.fused_linear import cat_linears
from hybridkv.models.weights.quantized_linear import DEQUANT_ROWS, Int4Linear, Int8Linear


def _parts(kind: str, bias: bool) -> list[nn.Module]:
    generator = torch.Generator().manual_seed(3)
    weights = [torch.randn(n, 128, generator=generator) * 0.05 for n in (96, 32, 32)]
    biases = [torch.randn(w.shape[0], generator=generator) if bias else None for w in weights]
    if kind == "int8":
        return [Int8Linear(w, b) for w, b in zip(weights, biases, strict=True)]
    if kind == "int4":
        return [Int4Linear(w, b) for w, b in zip(weights, biases, strict=True)]
    parts = []
    for w, b in zip(weights, biases, strict=True):
        linear = nn.Linear(128, w.shape[0], bias=bias)
        with torch.no_grad():
            linear.weight.copy_(w)
            if b is not None:
                linear.bias.copy_(b)
        parts.append(linear)
    return parts


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("kind", ["float32", "int8", "int4"])
@pytest.mark.parametrize("num_rows", [1, 8, DEQUANT_ROWS + 5])
def test_joined_layer_computes_the_parts_side_by_side(kind, bias, num_rows):
    """The joined layer's output is the parts' outputs concatenated, bit for bit, on
    the few-rows kernels and the many-rows path alike."""
    parts = _parts(kind, bias)
    joined = cat_linears(parts)
    assert joined is not None and type(joined) is type(parts[0])
    x = torch.randn(num_rows, 128, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        expected = torch.cat([part(x) for part in parts], dim=-1)
        assert torch.equal(joined(x), expected)


def test_parts_stored_differently_stay_apart():
    """An int4 part beside an int8 one (a file's 4-bit q beside its 6-bit v), a float
    one beside a quantised one, or parts of different input widths are not joined."""
    generator = torch.Generator().manual_seed(5)
    w = torch.randn(64, 128, generator=generator)
    assert cat_linears([Int4Linear(w), Int8Linear(w)]) is None
    assert cat_linears([nn.Linear(128, 64), Int8Linear(w)]) is None
    assert cat_linears([nn.Linear(128, 64), nn.Linear(64, 64)]) is None
