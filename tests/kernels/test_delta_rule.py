"""The gated delta rule: the chunked form equals the step-by-step recurrence, from any
carried state, with exact states at every checkpoint count, a decay per head (Gated
DeltaNet) or per key channel (Kimi Delta Attention); and transformers' own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.kernels.delta_rule import delta_rule_decode, delta_rule_states


def _inputs(
    length: int, heads: int = 3, dk: int = 8, dv: int = 6, seed: int = 0, channels: bool = False
):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(length, heads, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(length, heads, dk, generator=gen), dim=-1)
    v = torch.randn(length, heads, dv, generator=gen)
    g = -torch.rand(length, heads, *([dk] if channels else []), generator=gen)
    beta = torch.rand(length, heads, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen) * 0.5
    return q, k, v, g, beta, state


def _stepwise(q, k, v, g, beta, state):
    """The recurrence, one token at a time: every output and every state after."""
    outs, states, batched = [], [], state[None]
    for t in range(q.shape[0]):
        step = slice(t, t + 1)
        out, batched = delta_rule_decode(q[step], k[step], v[step], g[step], beta[step], batched)
        outs.append(out[0])
        states.append(batched[0])
    return torch.stack(outs), torch.stack(states)


@pytest.mark.parametrize("channels", [False, True])
@pytest.mark.parametrize(("length", "chunk"), [(1, 4), (7, 4), (16, 4), (37, 8), (40, 64)])
def test_chunked_equals_the_recurrence_with_states_at_every_count(length, chunk, channels) -> None:
    q, k, v, g, beta, state = _inputs(length, channels=channels)
    expected, every = _stepwise(q, k, v, g, beta, state)
    counts = sorted({c for c in (1, length // 3, length // 2, length) if c})
    out, states = delta_rule_states(q, k, v, g, beta, state, counts, chunk=chunk)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, every[[c - 1 for c in counts]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("channels", [False, True])
@pytest.mark.parametrize("first", [16, 5])
def test_block_end_counts_run_as_one_piece_and_stay_exact(first: int, channels: bool) -> None:
    """A prefill's counts (the block ends it crosses: evenly spaced after the first, then
    its end): the middle runs as one piece with a chunk per block, its states exact."""
    q, k, v, g, beta, state = _inputs(70, seed=5, channels=channels)
    expected, every = _stepwise(q, k, v, g, beta, state)
    counts = [*range(first, 70, 16), 70]
    out, states = delta_rule_states(q, k, v, g, beta, state, counts)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, every[[c - 1 for c in counts]], atol=1e-5, rtol=1e-5)


def test_matches_transformers_chunked_rule() -> None:
    """Qwen3-Next's torch fallback (keys and queries l2-normed inside it) on one request."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v, g, beta, state = _inputs(50, seed=3)
    ours, final = delta_rule_states(q, k, v, g, beta, state, [50])
    theirs, their_final = torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    torch.testing.assert_close(ours, theirs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final[0], their_final[0], atol=1e-5, rtol=1e-5)


def test_a_decay_per_key_channel_matches_transformers_kimi_delta_attention() -> None:
    """Kimi Linear's torch fallbacks, chunked over a prompt and recurrent for a decode,
    from a carried state, decays per key channel."""
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    q, k, v, g, beta, state = _inputs(45, seed=7, channels=True)
    ours, final = delta_rule_states(q[:44], k[:44], v[:44], g[:44], beta[:44], state, [44])
    theirs, their_final = kimi.chunk_kimi_delta_attention(
        q[None, :44], k[None, :44], v[None, :44], g=g[None, :44], beta=beta[None, :44],
        initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    torch.testing.assert_close(ours, theirs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final[0], their_final[0], atol=1e-5, rtol=1e-5)
    last = slice(44, 45)
    out, after = delta_rule_decode(q[last], k[last], v[last], g[last], beta[last], final)
    their_out, their_after = kimi.recurrent_kimi_delta_attention(
        q[None, last], k[None, last], v[None, last], g=g[None, last], beta=beta[None, last],
        initial_state=their_final, output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    torch.testing.assert_close(out, their_out[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after, their_after, atol=1e-5, rtol=1e-5)
