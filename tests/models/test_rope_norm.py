"""Rotary tables and norms in the forms the decode step runs them: the same values as
the reference's (transformers' Gemma 3 functions), for q and k heads side by side."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm, apply_rotary_pos_emb

from hybridkv.models.blocks.norms import RMSNorm, rms_norm
from hybridkv.models.blocks.rope import RotaryTable, apply_rope
from hybridkv.models.shapes.rope import RopeSpec, rope_from_hf


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


def _hf_config(rope: dict, **fields):
    from transformers import LlamaConfig

    fields = {"max_position_embeddings": 4096, **fields}
    return LlamaConfig(hidden_size=64, num_attention_heads=2, rope_parameters=rope, **fields)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 128},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
         "beta_fast": 16, "beta_slow": 2, "truncate": False},
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
         "mscale": 1.0, "mscale_all_dim": 0.8},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256,
         "attention_factor": 1.3},
        {"rope_type": "linear", "factor": 3.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 256},
    ],
    ids=["yarn", "yarn-untruncated", "yarn-mscale", "yarn-attention-factor", "linear", "llama3"],
)  # fmt: skip
def test_scaled_frequencies_are_transformers(rope):
    """Each scaling's frequencies and cos/sin multiplier as transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_theta": 10_000.0, **rope}
    config = _hf_config(dict(rope))
    expected, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    spec = RopeSpec.from_hf(rope, theta=1.0, max_positions=4096)
    table = RotaryTable(spec, head_dim=32, device="cpu")
    torch.testing.assert_close(table.inv_freq, expected, rtol=1e-6, atol=0)
    assert spec.attention_factor == pytest.approx(factor)
    cos, signed_sin = table.cos_sin(torch.tensor([5]), torch.float32)
    angle = 5 * table.inv_freq
    torch.testing.assert_close(cos[0, 0, :16], angle.cos() * factor)
    torch.testing.assert_close(signed_sin[0, 0, 16:], angle.sin() * factor)


def test_longrope_rotates_each_position_by_its_side_of_the_pretraining_context():
    """Positions inside ``original_max_position_embeddings`` by the short factors, those
    beyond by the long ones: what transformers uses for a sequence ending at each; the
    top-level fields of a Phi-3 config.json (rotary share, pretraining context) read."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    short, long = [1.0 + i / 10 for i in range(12)], [2.0 + i for i in range(12)]
    hub = {
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 64,
        "max_position_embeddings": 1024,
        "rope_theta": 10_000.0,
        "rope_scaling": {"type": "longrope", "short_factor": short, "long_factor": long},
    }
    config = Phi3Config(hidden_size=128, num_attention_heads=4, **hub)
    init = ROPE_INIT_FUNCTIONS["longrope"]
    (short_freq, factor), (long_freq, _) = init(config, "cpu"), init(config, "cpu", seq_len=65)
    spec = rope_from_hf(hub, default_theta=1.0)
    assert (spec.original_max_position_embeddings, spec.partial_rotary_factor) == (64, 0.75)
    assert spec.attention_factor == pytest.approx(factor) and factor > 1
    table = RotaryTable(spec, head_dim=32, device="cpu")
    cos, _ = table.cos_sin(torch.tensor([63, 64]), torch.float32)
    torch.testing.assert_close(cos[0, 0, :12], (63 * short_freq).cos() * factor)
    torch.testing.assert_close(cos[1, 0, :12], (64 * long_freq).cos() * factor)


def test_dynamic_ntk_rotates_each_position_as_a_sequence_ending_there():
    """Inside ``max_position_embeddings``: plain rope; beyond, position p by the base
    transformers computes for a sequence of p + 1 tokens."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10_000.0}
    config = _hf_config(dict(rope), max_position_embeddings=64)
    spec = RopeSpec.from_hf(rope, theta=1.0, max_positions=64)
    table = RotaryTable(spec, head_dim=32, device="cpu")
    plain = RotaryTable(RopeSpec(theta=10_000.0), head_dim=32, device="cpu")
    positions = torch.tensor([0, 63, 64, 200])
    cos, _ = table.cos_sin(positions, torch.float32)
    torch.testing.assert_close(cos[:2], plain.cos_sin(positions[:2], torch.float32)[0])
    for row, p in ((2, 64), (3, 200)):
        freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=p + 1)
        torch.testing.assert_close(cos[row, 0, :16], (p * freq).cos())
