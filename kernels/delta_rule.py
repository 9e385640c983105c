"""The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5) in plain torch: a chunked form
for prefill and the recurrence for decode, over one state per value head.

Per value head, a ``[Dk, Dv]`` state ``S`` and, for each token, a query ``q``, key ``k``
(both unit length), value ``v``, decay ``g <= 0`` (log space) and rate ``beta``::

    S <- exp(g) S                          the old memory fades
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
    ``g``, ``beta`` ``[B, H]``, ``state`` ``[B, H, Dk, Dv]``.

    Returns ``([B, H, Dv]`` outputs in ``v``'s dtype, ``[B, H, Dk, Dv]`` the states after).
    """
    q, k, v = q.float() * q.shape[-1] ** -0.5, k.float(), v.float()
    state = state.float() * g.float().exp()[..., None, None]
    delta = (v - (state * k[..., None]).sum(-2)) * beta.float()[..., None]
    state = state + k[..., None] * delta[..., None, :]
    out = (state * q[..., None]).sum(-2)
    return out.to(v.dtype), state


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
    """One request's tokens: ``q``, ``k`` ``[L, H, Dk]``, ``v`` ``[L, H, Dv]``, ``g``,
    ``beta`` ``[L, H]``, from ``state`` ``[H, Dk, Dv]``; with the state after each of
    ``counts`` tokens (ascending, in ``[1, L]``, the last ``L``).

    Each piece between two counts runs chunked from the state the one before left, so the
    states at the counts are exact, not interpolated.

    Returns ``([L, H, Dv]`` outputs in ``v``'s dtype, ``[len(counts), H, Dk, Dv]`` states).
    """
    outputs, states, start = [], [], 0
    state = state.float()
    for end in counts:
        if end > start:
            piece = slice(start, end)
            out, state = _chunked(q[piece], k[piece], v[piece], g[piece], beta[piece], state, chunk)
            outputs.append(out)
        states.append(state)
        start = end
    return torch.cat(outputs).to(v.dtype), torch.stack(states)


def _chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked form over one piece: float32 ``[L, H, Dv]`` and the state after it."""
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
    decay = g.cumsum(-1)  # [H, C, chunk]: log decay from the chunk's start to each position
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf"))
    pairwise = pairwise.exp()
    # The UT system: (I + strictly lower (beta k k^T) decayed) u = beta v, and likewise
    # for the decayed keys that read the state carried in.
    system = (k_beta @ k.transpose(-1, -2) * pairwise).tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    values = torch.linalg.solve_triangular(system + eye, v_beta, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(
        system + eye, k_beta * decay.exp()[..., None], upper=False, unitriangular=True
    )
    scores = q @ k.transpose(-1, -2) * pairwise
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(values)
    for c in range(q.shape[1]):
        new = values[:, c] - reads[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + scores[:, c] @ new
        state = state * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ new
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :length].transpose(0, 1), state
