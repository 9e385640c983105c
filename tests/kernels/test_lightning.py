"""Lightning attention (MiniMax) on the SSD kernels: the chunked form over a prompt
longer than a chunk equals the recurrence token by token, from a carried state, with the
state at every checkpoint count; and both equal the decayed linear attention written out."""

from __future__ import annotations

import pytest
import torch

from hybridkv.models.blocks.lightning import LightningAttention
from hybridkv.models.shapes.lightning import LightningShape

SHAPE = LightningShape(hidden_size=32, num_heads=4, head_dim=8, num_layers=6)


def _mixer(layer: int) -> LightningAttention:
    mixer = LightningAttention(SHAPE, layer)
    mixer.load_state_dict(
        {
            "qkv_proj.weight": torch.randn(96, 32),
            "output_gate.weight": torch.randn(32, 32),
            "out_proj.weight": torch.randn(32, 32),
            "norm.weight": torch.ones(32),
        },
        strict=False,
        assign=True,
    )
    return mixer


def _written_out(mixer, v, k, q, state):
    """``S_t = exp(-s) S_{t-1} + v_t k_t^T``, ``o_t = S_t q_t``, per head, in float64."""
    decay = torch.exp(-mixer.slope_rate.double().view(-1, 1, 1))
    s, outs, states = state.double(), [], []
    for t in range(v.shape[0]):
        s = decay * s + v[t].double()[:, :, None] * k[t].double()[:, None, :]
        outs.append(torch.einsum("hpn,hn->hp", s, q[t].double()).reshape(-1))
        states.append(s)
    return torch.stack(outs), torch.stack(states)


@pytest.mark.parametrize(("length", "layer"), [(1, 0), (50, 0), (130, 3), (64, 5)])
def test_chunked_equals_the_recurrence_and_the_formula(length, layer) -> None:
    torch.manual_seed(length + layer)
    mixer = _mixer(layer)
    v, k, q = (torch.randn(length, 4, 8) * 0.5 for _ in range(3))
    state = torch.randn(1, 4, 8, 8) * 0.3
    counts = sorted({c for c in (1, length // 3, length // 2, length) if c})
    out, (states,) = mixer.scan((v, k, q), (state,), counts)
    expected, every = _written_out(mixer, v, k, q, state[0])
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        states.double(), every[[c - 1 for c in counts]], atol=1e-4, rtol=1e-4
    )
    stepped, carried = [], state
    for t in range(length):
        row, (carried,) = mixer.step((v[t : t + 1], k[t : t + 1], q[t : t + 1]), (carried,))
        stepped.append(row[0])
    torch.testing.assert_close(torch.stack(stepped), out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(carried[0], states[-1], atol=1e-4, rtol=1e-4)


def test_rates_fall_with_depth_as_minimax_derives_them() -> None:
    """Head h of layer l of L decays by ``2 ** (-8 (h + 1) / H) * (1 - l / (L - 1))``."""
    first, last = _mixer(0).slope_rate.view(-1), _mixer(5).slope_rate.view(-1)
    expected = 2.0 ** (-8 * (torch.arange(4) + 1) / 4) * (1 + 1e-5)
    torch.testing.assert_close(first, expected)
    assert torch.all(last < 1e-4)
