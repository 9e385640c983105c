"""Mamba1's selective scan: a prompt in pieces equals it whole and step by step, with the
states at every count; and transformers' own torch form."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridkv.kernels.selective_scan import selective_scan_decode, selective_scan_states


def _inputs(length: int, channels: int = 6, size: int = 4):
    gen = torch.Generator().manual_seed(length)
    x = torch.randn(length, channels, generator=gen)
    dt = F.softplus(torch.randn(length, channels, generator=gen))
    a = -torch.rand(channels, size, generator=gen) * 2
    b, c = torch.randn(length, size, generator=gen), torch.randn(length, size, generator=gen)
    d = torch.randn(channels, generator=gen)
    return x, dt, a, b, c, d


def test_pieces_steps_and_whole_agree() -> None:
    x, dt, a, b, c, d = _inputs(20)
    whole, states = selective_scan_states(x, dt, a, b, c, d, torch.zeros(6, 4), [7, 20])
    head, tail = slice(0, 7), slice(7, 20)
    first, kept = selective_scan_states(
        x[head], dt[head], a, b[head], c[head], d, torch.zeros(6, 4), [7]
    )
    rest, _ = selective_scan_states(x[tail], dt[tail], a, b[tail], c[tail], d, kept[0], [13])
    torch.testing.assert_close(torch.cat((first, rest)), whole)
    state, steps = torch.zeros(1, 6, 4), []
    for t in range(20):
        y, state = selective_scan_decode(x[t : t + 1], dt[t : t + 1], a, b[t : t + 1],
                                         c[t : t + 1], d, state)  # fmt: skip
        steps.append(y[0])
    torch.testing.assert_close(torch.stack(steps), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[0], states[1], atol=1e-5, rtol=1e-5)


def test_matches_transformers_torch_scan() -> None:
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan

    x, dt, a, b, c, d = _inputs(30)
    ours, _ = selective_scan_states(x, dt, a, b, c, d, torch.zeros(6, 4), [30])
    theirs = mamba_selective_scan(x.t()[None], dt.t()[None], a, b.t()[None], c.t()[None], d)
    torch.testing.assert_close(ours, theirs[0].t(), atol=1e-5, rtol=1e-5)
