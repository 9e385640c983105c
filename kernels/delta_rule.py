"""The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5; Kimi Delta Attention: Kimi
Linear) in plain torch: a chunked form for prefill and the recurrence for decode, over one
state per value head.

Per value head, a ``[Dk, Dv]`` state ``S`` and, for each token, a query ``q``, key ``k``
(both unit length), value ``v``, decay ``g <= 0`` (log space: one per head, or one per key
channel in Kimi Delta Attention, each row of ``S`` fading at its own rate) and rate
``beta``::

    S <- diag(exp(g)) S                    the old memory fades
    S <- S + k (beta (v - k^T S))^T        the delta rule: write only what S mispredicts
    o  = S^T q / sqrt(Dk)

The chunked form (DeltaNet's UT transform, arXiv 2406.06484 section 3; gated as in
arXiv 2412.06464) solves ``chunk`` tokens at once with two triangular solves and carries
only the state between chunks. Like ``kernels/ssm.py`` every function takes the state
before some tokens and returns it after them, so a prompt runs in pieces, a piece can
start from a state restored from the prefix cache, and a decode is one step; the states
are float32 whatever the inputs. Keys and queries arrive with as many heads as values
(a model with fewer key heads repeats them first). This imports nothing of hybridkv.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request, batched: ``q``, ``k`` ``[B, H, Dk]``, ``v`` ``[B, H, Dv]``,
    ``g`` ``[B, H]`` (or ``[B, H, Dk]``: a decay per key channel), ``beta`` ``[B, H]``,
    ``state`` ``[B, H, Dk, Dv]``.

    Returns ``([B, H, Dv]`` outputs in ``v``'s dtype, ``[B, H, Dk, Dv]`` the states after).
    """
    dtype = v.dtype
    q, k, v = q.float() * q.shape[-1] ** -0.5, k.float(), v.float()
    decay = g.float().exp()
    state = state.float() * (decay[..., None] if decay.dim() == k.dim() else decay[..., None, None])
    delta = (v - (state * k[..., None]).sum(-2)) * beta.float()[..., None]
    state = state + k[..., None] * delta[..., None, :]
    out = (state * q[..., None]).sum(-2)
    return out.to(dtype), state


def delta_rule_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    counts: Sequence[int],
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's tokens: ``q``, ``k`` ``[L, H, Dk]``, ``v`` ``[L, H, Dv]``, ``g``
    ``[L, H]`` (or ``[L, H, Dk]``), ``beta`` ``[L, H]``, from ``state`` ``[H, Dk, Dv]``; with
    the state after each of ``counts`` tokens (ascending, in ``[1, L]``, the last ``L``).

    The states at the counts are exact, not interpolated: the tokens up to the first count
    run as one piece, those between counts evenly spaced (a prefill's block ends) as one
    piece whose chunks end at the counts, and the rest as one piece; counts not evenly
    spaced run piece by piece.

    Returns ``([L, H, Dv]`` outputs in ``v``'s dtype, ``[len(counts), H, Dk, Dv]`` states).
    """
    counts = list(counts)
    state = state.float()
    pieces: list[tuple[int, int, int | None]] = []  # (start, end, chunk ending at counts)
    steps = {b - a for a, b in itertools.pairwise(counts[:-1])}
    if len(counts) > 2 and len(steps) == 1:
        step = steps.pop()
        pieces = [
            (0, counts[0], None),
            (counts[0], counts[-2], step),
            (counts[-2], counts[-1], None),
        ]
    else:
        pieces = [(a, b, None) for a, b in itertools.pairwise([0, *counts])]
    outputs, states = [], []
    for start, end, every in pieces:
        if end > start:
            piece = slice(start, end)
            size = chunk if every is None or chunk % every == 0 else every
            out, kept = _chunked(
                q[piece], k[piece], v[piece], g[piece], beta[piece], state, size, every
            )  # fmt: skip
            outputs.append(out)
            states.extend(kept)
            state = kept[-1]
        elif start == 0 or every is None:
            states.append(state)
    return torch.cat(outputs).to(v.dtype), torch.stack(states)


def _chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
    every: int | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The chunked form over one piece: float32 ``[L, H, Dv]`` and the state after it, or
    after every ``every`` tokens (a divisor of ``chunk``; the piece a multiple of it):
    within a chunk, the state at ``t`` is the chunk's first state decayed to ``t`` plus
    each new value up to ``t`` written through its key decayed to ``t``."""
    length = q.shape[0]
    pad = (chunk - length % chunk) % chunk

    # [H, chunks, chunk, D] in float32, the piece padded with tokens that change nothing
    # (zero keys and values, no decay, zero rate).
    def heads(x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x.float().transpose(0, 1), (0, 0, 0, pad) if x.dim() == 3 else (0, pad))
        return x.reshape(x.shape[0], -1, chunk, *x.shape[2:])

    q, k, v, g, beta = (heads(x) for x in (q, k, v, g, beta))
    q = q * q.shape[-1] ** -0.5
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # [H, C, chunk, 1 or Dk]: log decay from the chunk's start to each position, per head
    # or per key channel.
    decay = g.cumsum(2)
    decay = decay[..., None] if decay.dim() == 3 else decay
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # The UT system: (I + strictly lower (beta k k^T) decayed) u = beta v, and likewise
    # for the decayed keys that read the state carried in.
    system = _decayed_products(k_beta, k, decay, causal).tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    values = torch.linalg.solve_triangular(system + eye, v_beta, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(
        system + eye, k_beta * decay.exp(), upper=False, unitriangular=True
    )
    scores = _decayed_products(q, k, decay, causal)
    q_decayed = q * decay.exp()
    k_to_end = k * (decay[..., -1:, :] - decay).exp()
    chunk_decay = decay[..., -1, :].exp()[..., None]  # [H, C, 1 or Dk, 1]
    if every is not None:  # [H, C, ends, chunk, 1 or Dk]: each key's decay to each end
        ends = torch.arange(every - 1, chunk, every, device=q.device)
        upto = torch.arange(chunk, device=q.device)[None, :] <= ends[:, None]
        to_ends = decay[..., ends, None, :] - decay[..., None, :, :]
        to_ends = to_ends.masked_fill(~upto[..., None], float("-inf")).exp()
        end_decay = decay[..., ends, :].exp()[..., None]  # [H, C, ends, 1 or Dk, 1]
    out = torch.empty_like(values)
    kept = []
    for c in range(q.shape[1]):
        new = values[:, c] - reads[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + scores[:, c] @ new
        if every is not None:  # (k decayed to each end)^T new
            written = (k[:, c, None] * to_ends[:, c]).transpose(-1, -2) @ new[:, None]
            kept.extend((state[:, None] * end_decay[:, c] + written).unbind(1))
        state = state * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ new
    out = out.reshape(out.shape[0], -1, out.shape[-1])[:, :length].transpose(0, 1)
    return out, kept[: length // every] if every is not None else [state]


def _decayed_products(
    a: torch.Tensor, b: torch.Tensor, decay: torch.Tensor, causal: torch.Tensor
) -> torch.Tensor:
    """``[H, C, n, n]``: ``sum_d a[i, d] b[j, d] exp(decay[i, d] - decay[j, d])`` for
    ``j <= i`` in each chunk, 0 above: ``a @ b^T`` times one decay per pair where the decay
    is per head (``decay`` ``[H, C, n, 1]``); per key channel (``[H, C, n, Dk]``) the decay
    stays inside the sum, a chunk at a time (``[H, n, n, Dk]`` at once)."""
    if decay.shape[-1] == 1:
        pairwise = (decay - decay.transpose(-1, -2)).masked_fill(~causal, float("-inf"))
        return a @ b.transpose(-1, -2) * pairwise.exp()
    out = []
    for c in range(a.shape[1]):
        pairwise = decay[:, c, :, None] - decay[:, c, None]  # [H, n, n, Dk]
        pairwise = pairwise.masked_fill(~causal[..., None], float("-inf")).exp()
        out.append((a[:, c, :, None] * b[:, c, None] * pairwise).sum(-1))
    return torch.stack(out, dim=1)
