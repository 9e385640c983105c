"""Mamba1's selective scan in plain torch (Jamba's mixer): per channel ``d`` and state
``n``, ``h = exp(dt_d A_dn) h + dt_d B_n x_d``, ``y_d = sum_n C_n h_dn + D_d x_d``.

As ``kernels/ssm.py`` does for Mamba2, every function takes the state before some tokens
and returns it after them (float32, ``[channels, state]``), so a prompt runs in pieces
from a state restored from the prefix cache and a decode is one step. The scan runs token
by token (transformers' torch form does too): A is per channel and state, so the
chunked products SSD uses for Mamba2 would take a ``[chunk, chunk, channels, state]``
tensor. This imports nothing of hybridkv.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def selective_scan_states(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
    counts: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's tokens: ``x``, ``dt`` ``[L, D]`` (dt after its softplus), ``a``
    ``[D, N]``, ``b``, ``c`` ``[L, N]``, ``d`` ``[D]``, from ``state`` ``[D, N]``; with the
    state after each of ``counts`` tokens (ascending, in ``[1, L]``).

    Returns ``([L, D]`` outputs in ``x``'s dtype, ``[len(counts), D, N]`` states).
    """
    decay = torch.exp(dt.float()[:, :, None] * a.float())  # [L, D, N]
    written = (dt.float() * x.float())[:, :, None] * b.float()[:, None, :]
    state = state.float()
    wanted, kept, outputs = set(counts), [], []
    for t in range(x.shape[0]):
        state = decay[t] * state + written[t]
        outputs.append(state @ c[t].float())
        if t + 1 in wanted:
            kept.append(state)
    y = torch.stack(outputs) + x.float() * d.float()
    return y.to(x.dtype), torch.stack(kept)


def selective_scan_decode(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request: ``x``, ``dt`` ``[B, D]``, ``b``, ``c`` ``[B, N]``, ``state``
    ``[B, D, N]``. Returns ``([B, D]`` outputs, ``[B, D, N]`` the states after)."""
    decay = torch.exp(dt.float()[:, :, None] * a.float())
    state = decay * state.float() + (dt.float() * x.float())[:, :, None] * b.float()[:, None, :]
    y = (state @ c.float()[:, :, None])[:, :, 0] + x.float() * d.float()
    return y.to(x.dtype), state
