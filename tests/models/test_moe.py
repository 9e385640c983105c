"""The mixture of experts: one grouped matmul over experts' runs equals routing token by
token, with or without ``F.grouped_mm`` in torch; sizes its rows cannot align are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.models.blocks.moe import MixtureOfExperts
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.shapes.moe import ExpertsShape

HIDDEN, INNER, EXPERTS, TOP_K = 16, 24, 6, 2


def _experts() -> MixtureOfExperts:
    moe = MixtureOfExperts(HIDDEN, ExpertsShape(num_experts=EXPERTS, top_k=TOP_K, inner=INNER))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return moe


def _token_by_token(moe: MixtureOfExperts, x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t, row in enumerate(x):
        top, chosen = moe.router.layer(row).float().topk(TOP_K)
        for weight, e in zip(torch.softmax(top, -1).tolist(), chosen.tolist(), strict=True):
            gate, up = (moe.input_linear.weight[e] @ row).chunk(2)
            out[t] += weight * (moe.output_linear.weight[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("grouped_mm", [True, False])
def test_experts_equal_routing_token_by_token(
    grouped_mm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uneven runs, some experts with no token: the same output either way."""
    if not grouped_mm:
        monkeypatch.delattr(F, "grouped_mm", raising=False)
    moe = _experts()
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(moe(x), _token_by_token(moe, x), atol=1e-5, rtol=1e-5)


def test_sizes_not_multiples_of_eight_are_refused() -> None:
    with pytest.raises(ModelConfigError, match="width 60 and inner size 24"):
        MixtureOfExperts(60, ExpertsShape(num_experts=EXPERTS, top_k=TOP_K, inner=24))


def test_gpt_oss_experts_load_and_match_transformers() -> None:
    """gpt-oss's stacks (transposed, gate and up alternating, biased), its biased router
    and its clamped SwiGLU: the same output as transformers' block, with activations
    wide enough that the clamp cuts."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(
        hidden_size=HIDDEN, intermediate_size=INNER, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, swiglu_limit=1.5,
    )  # fmt: skip
    reference = GptOssMLP(config)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    shape = ExpertsShape(
        num_experts=EXPERTS, top_k=TOP_K, inner=INNER, bias=True, activation="clamped",
        limit=1.5,
    )  # fmt: skip
    moe = MixtureOfExperts(HIDDEN, shape)
    moe.load_state_dict(reference.state_dict())
    x = torch.randn(13, HIDDEN, generator=generator)
    with torch.no_grad():
        gate_up = x @ reference.experts.gate_up_proj[0]
        assert (gate_up.abs() > 1.5).any(), "the clamp cuts"
        expected, _ = reference(x[None])
        torch.testing.assert_close(moe(x), expected[0], atol=1e-5, rtol=1e-5)


def test_weight_quantisation_leaves_the_router_in_the_model_dtype() -> None:
    """``--weights int8`` replaces the experts' neighbours, never the router: a flipped
    expert choice costs more than the router's bytes."""
    from torch import nn

    from hybridkv.models.blocks.moe import RouterLinear
    from hybridkv.models.weights.precision import quantize_linears

    model = nn.ModuleDict({"moe": _experts(), "proj": nn.Linear(HIDDEN, HIDDEN)})
    assert quantize_linears(model, "int8", device=torch.device("cpu")) == 1
    assert type(model["moe"].router.layer) is RouterLinear
