"""Rotary tables and norms in the forms the decode step runs them: the same values as
the reference's (transformers' Gemma 3 functions), for q and k heads side by side."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm, apply_rotary_pos_emb

from hybridkv.models.blocks.norms import RMSNorm, rms_norm
from hybridkv.models.blocks.rope import RotaryTable, apply_rope
from hybridkv.models.shapes.rope import RopeSpec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_is_the_references_bit_for_bit(dtype):
    """cos and the signed sines rotate as ``x * cos + rotate_half(x) * sin`` does."""
    generator = torch.Generator().manual_seed(0)
    table = RotaryTable(RopeSpec(theta=10_000.0), head_dim=64, device="cpu")
    positions = torch.tensor([0, 3, 17, 4095])
    x = torch.randn(4, 5, 64, generator=generator).to(dtype)
    cos, signed_sin = table.cos_sin(positions, dtype)
    freqs = positions.float()[:, None] * table.inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    ref_cos, ref_sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected, _ = apply_rotary_pos_emb(x, x, ref_cos, ref_sin, unsqueeze_dim=1)
    assert torch.equal(apply_rope(x, cos, signed_sin), expected)


def test_partial_rotation_leaves_the_rest_of_each_head():
    """A table narrower than the head rotates the head's first channels only."""
    table = RotaryTable(RopeSpec(theta=10_000.0, partial_rotary_factor=0.5), 64, "cpu")
    x = torch.randn(3, 2, 64)
    cos, signed_sin = table.cos_sin(torch.tensor([1, 2, 9]), torch.float32)
    out = apply_rope(x, cos, signed_sin)
    assert torch.equal(out[..., 32:], x[..., 32:])
    assert torch.equal(out[..., :32], apply_rope(x[..., :32].contiguous(), cos, signed_sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norm_matches_the_reference_and_keeps_its_scale(dtype):
    """Gemma's ``(1 + weight)`` norm as transformers computes it; the scale is made once
    per weight and made again when the weight is replaced."""
    generator = torch.Generator().manual_seed(1)
    ref = Gemma3RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(32, generator=generator))
    norm = RMSNorm(32, 1e-6, offset=1.0)
    norm.weight = torch.nn.Parameter(ref.weight.detach().clone())
    x = torch.randn(6, 32, generator=generator).to(dtype)
    torch.testing.assert_close(norm(x), ref(x))
    assert norm.scale() is norm.scale()
    norm.weight = torch.nn.Parameter(torch.zeros(32))
    x32 = x.float()
    expected = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x).float(), expected.to(dtype).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
def test_heads_side_by_side_normalise_as_each_norm_alone(dtype, offset):
    """q heads and k heads in one call, each row scaled by its own norm's weights, give
    what the q norm and the k norm give apart."""
    generator = torch.Generator().manual_seed(2)
    q_norm, k_norm = RMSNorm(16, 1e-6, offset), RMSNorm(16, 1e-6, offset)
    for norm in (q_norm, k_norm):
        norm.weight = torch.nn.Parameter(torch.randn(16, generator=generator).to(dtype))
    qk = torch.randn(3, 4 + 1, 16, generator=generator).to(dtype)
    scale = torch.cat((q_norm.scale().expand(4, -1), k_norm.scale().expand(1, -1)))
    joined = rms_norm(qk, scale, 1e-6, scale_first=bool(offset))
    torch.testing.assert_close(joined[:, :4], q_norm(qk[:, :4]), rtol=0, atol=0)
    torch.testing.assert_close(joined[:, 4:], k_norm(qk[:, 4:]), rtol=0, atol=0)
