"""The mixture of experts: one grouped matmul over experts' runs equals routing token by
token, with or without ``F.grouped_mm`` in torch; sizes its rows cannot align are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.models.blocks.moe import MixtureOfExperts
from hybridkv.models.errors import ModelConfigError

HIDDEN, INNER, EXPERTS, TOP_K = 16, 24, 6, 2


def _experts() -> MixtureOfExperts:
    moe = MixtureOfExperts(HIDDEN, INNER, EXPERTS, TOP_K)
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
    with pytest.raises(ModelConfigError, match="hidden size 60 and inner size 24"):
        MixtureOfExperts(60, 24, EXPERTS, TOP_K)
