"""Mamba2 state-space kernels in plain torch: the causal convolution and the SSD scan.

A Mamba2 layer keeps, per request, a fixed-size state instead of a KV cache: the last
``K - 1`` inputs of its depthwise causal convolution (``conv_state``, ``[D, K-1]``) and the
SSM state of every head (``ssm_state``, ``[H, P, N]``). Each function here takes the state
before some tokens and returns the state after them, so a prompt can be run in chunks, a
chunk can start from a state restored from the prefix cache, and decodes run one token at
a time; the result is the same as running the whole sequence at once::

    tokens      t0 t1 t2 t3 | t4 t5 t6 | t7        three calls, states handed on
    state       s(-1)  ->  s(3)  ->  s(6)  ->  s(7)

SSD (state-space duality): within a chunk of ``chunk_size`` positions the recurrence
``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``, ``y_t = C_t h_t + D x_t`` is computed as a
masked, decayed attention-like product; between chunks only the ``[H, P, N]`` states are
carried. Scores and states are float32 whatever the input dtype (the state accumulates
over the whole sequence). This imports nothing of hybridkv.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of one request's chunk, then SiLU.

    Args:
        x: ``[L, D]`` the chunk's inputs, in order.
        conv_state: ``[D, K-1]`` the inputs before the chunk (zeros at the start).
        weight: ``[D, K]`` one filter per channel.
        bias: ``[D]`` or None.

    Returns:
        ``([L, D]`` outputs, ``[D, K-1]`` the state after the chunk).
    """
    out, states = causal_conv1d_states(x, conv_state, weight, bias, (x.shape[0],))
    return out, states[0]


def causal_conv1d_states(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    counts: Sequence[int],
    *,
    silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_conv1d`, with the state after each of ``counts`` tokens of the chunk
    (without the SiLU where not ``silu``: LFM2's short convolutions).

    The state after ``t`` tokens is the ``K-1`` inputs before position ``t``::

        window   s s s | x0 x1 x2 x3 x4       K=4, the carried state s first
        after 2            s x0 x1            window[:, 2 : 2 + K-1]

    Returns ``([L, D]`` outputs, ``[len(counts), D, K-1]`` states), counts in ``[0, L]``.
    """
    width = weight.shape[1]
    window = torch.cat([conv_state.to(x.dtype), x.t()], dim=1)  # [D, K-1+L]
    out = F.conv1d(window[None], weight[:, None, :], bias, groups=weight.shape[0])[0]
    index = torch.tensor(list(counts), dtype=torch.long, device=x.device)
    states = window.unfold(1, width - 1, 1).index_select(1, index)  # [D, I, K-1]
    return F.silu(out.t()) if silu else out.t(), states.permute(1, 0, 2)


def causal_conv1d_decode(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token per request, batched: ``x`` ``[B, D]``, ``conv_states`` ``[B, D, K-1]``.

    Returns ``([B, D]`` outputs after SiLU (where ``silu``), ``[B, D, K-1]`` the states
    after the token).
    """
    window = torch.cat([conv_states.to(x.dtype), x[:, :, None]], dim=2)  # [B, D, K]
    out = (window * weight).sum(-1)
    if bias is not None:
        out = out + bias
    return F.silu(out) if silu else out, window[:, :, 1:]


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum(a[..., j+1 : i+1])`` for ``j <= i``, else -inf (``a``: ``[..., T]``).

    Summed directly rather than as a difference of cumulative sums, which loses precision
    once the decays add up to hundreds over a long chunk.
    """
    size = a.shape[-1]
    grid = a[..., :, None].expand(*a.shape, size)  # grid[..., i, j] = a[i]
    strictly_below = torch.ones(size, size, dtype=torch.bool, device=a.device).tril(-1)
    out = torch.cumsum(grid.masked_fill(~strictly_below, 0), dim=-2)
    below = torch.ones(size, size, dtype=torch.bool, device=a.device).tril()
    return out.masked_fill(~below, float("-inf"))


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    ssm_state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD chunked scan of one request's chunk, from the state before it.

    Args:
        x: ``[L, H, P]`` inputs per head.
        dt: ``[L, H]`` time steps, already biased, softplus-ed and clamped.
        a: ``[H]`` the (negative) state decay rates, ``-exp(A_log)``.
        b: ``[L, G, N]`` input projections, G groups shared by ``H // G`` heads each.
        c: ``[L, G, N]`` output projections.
        d: ``[H]`` skip connection.
        ssm_state: ``[H, P, N]`` the state before the chunk (zeros at the start).
        chunk_size: positions per SSD chunk; any length works, the last chunk is padded.

    Returns:
        ``([L, H, P]`` outputs in x's dtype, ``[H, P, N]`` float32 state after the chunk).
    """
    y, states = ssd_scan_states(x, dt, a, b, c, d, ssm_state, chunk_size, ())
    return y, states[-1]


def ssd_scan_states(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    ssm_state: torch.Tensor,
    chunk_size: int,
    counts: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ssd_scan`, with the state after each of ``counts`` tokens (in ``[1, L]``) too.

    The executor checkpoints a request's state at block boundaries inside a prefill chunk
    this way, in the same pass: the state after ``t`` tokens is the state entering t's SSD
    chunk, decayed to t, plus that chunk's inputs up to t::

        SSD chunks   [0 ........ 7] [8 ........ 15] [16 .. 20]     chunk_size 8, L = 21
        counts                  t=6            t=12
        state(12)  = exp(decay(8..11)) * entering(8) + sum_{s=8..11} decayed B_s x_s

    Returns:
        ``([L, H, P]`` outputs in x's dtype, ``[len(counts) + 1, H, P, N]`` float32 states:
        after each count, then after the whole chunk).
    """
    length, num_heads, _ = x.shape
    repeat = num_heads // b.shape[1]
    xf, dtf = x.float(), dt.float()
    bf = b.float().repeat_interleave(repeat, dim=1)  # [L, H, N]
    cf = c.float().repeat_interleave(repeat, dim=1)
    pad = (-length) % chunk_size
    num_chunks = (length + pad) // chunk_size

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [L, ...] -> [C, chunk, ...]
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.reshape(num_chunks, chunk_size, *t.shape[1:])

    xs = chunks(xf * dtf[..., None])  # [C, l, H, P]: dt folded into the input
    bs, cs = chunks(bf), chunks(cf)  # [C, l, H, N]
    decay = chunks(dtf * a.float()).permute(0, 2, 1)  # [C, H, l]; padding decays by 0
    cumulative = torch.cumsum(decay, dim=-1)

    # Within chunks: y_t = sum_{s <= t} C_t.B_s exp(sum decay (s, t]) x_s.
    weights = torch.exp(_segment_sum(decay))  # [C, H, l, s]
    scores = torch.einsum("clhn,cshn->chls", cs, bs) * weights
    y = torch.einsum("chls,cshp->clhp", scores, xs)

    # Each chunk's own contribution to the state at its end.
    to_end = torch.exp(cumulative[..., -1:] - cumulative)  # [C, H, l]
    chunk_states = torch.einsum("clhn,chl,clhp->chpn", bs, to_end, xs)

    # Across chunks: the state entering chunk k, from the initial state and chunks < k.
    totals = F.pad(cumulative[..., -1], (0, 0, 1, 0))  # [C+1, H], a zero step first
    carry = torch.exp(_segment_sum(totals.t())).permute(1, 2, 0)  # [C+1, C+1, H]
    states = torch.cat([ssm_state.float()[None], chunk_states], dim=0)  # [C+1, H, P, N]
    entering = torch.einsum("zkh,khpn->zhpn", carry, states)  # state after chunk z-1
    start, final = entering[:-1], entering[-1]

    # The entering state's share of each output, decayed to the output's position.
    y = y + torch.einsum("clhn,chpn,chl->clhp", cs, start, torch.exp(cumulative))
    y = y.reshape(num_chunks * chunk_size, num_heads, -1)[:length]
    y = y + xf * d.float()[:, None]
    if not counts:
        return y.to(x.dtype), final[None]
    index = torch.tensor(list(counts), dtype=torch.long, device=x.device) - 1
    chunk, offset = index // chunk_size, index % chunk_size
    upto = cumulative[chunk]  # [I, H, l]
    at = upto.gather(2, offset[:, None, None].expand(-1, num_heads, 1))  # [I, H, 1]
    within = torch.arange(chunk_size, device=x.device)[None, :] <= offset[:, None]  # [I, l]
    to_count = torch.exp((at - upto).masked_fill(~within[:, None, :], float("-inf")))
    inside = torch.einsum("ihs,ishn,ishp->ihpn", to_count, bs[chunk], xs[chunk])
    at_counts = torch.exp(at)[..., None] * start[chunk] + inside
    return y.to(x.dtype), torch.cat([at_counts, final[None]], dim=0)


def ssd_decode(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    ssm_states: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token per request, batched: the recurrence itself, in float32.

    Shapes as :func:`ssd_scan` with a batch dimension instead of the sequence: ``x``
    ``[B, H, P]``, ``dt`` ``[B, H]``, ``b``/``c`` ``[B, G, N]``, ``ssm_states`` ``[B, H, P, N]``.
    Returns ``([B, H, P]`` outputs in x's dtype, ``[B, H, P, N]`` the states after the token).
    """
    repeat = x.shape[1] // b.shape[1]
    dtf = dt.float()
    bf = b.float().repeat_interleave(repeat, dim=1)  # [B, H, N]
    cf = c.float().repeat_interleave(repeat, dim=1)
    decay = torch.exp(dtf * a.float())[..., None, None]  # [B, H, 1, 1]
    update = (dtf[..., None] * x.float())[..., None] * bf[:, :, None, :]  # [B, H, P, N]
    states = ssm_states.float() * decay + update
    y = torch.einsum("bhpn,bhn->bhp", states, cf) + x.float() * d.float()[:, None]
    return y.to(x.dtype), states
