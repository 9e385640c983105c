"""Partial attention over key shards, merged by log-sum-exp, equals attention over all keys."""

from __future__ import annotations

import pytest
import torch

from hybridkv.kernels.errors import KernelInputError
from hybridkv.kernels.lse_merge import merge_partials
from hybridkv.kernels.partial_attention import partial_attention


def _reference(q, k, v, q_pos, k_pos, q_seq, k_seq, scale, window, softcap) -> torch.Tensor:
    """Per query, softmax over the keys it may read, one query at a time."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for t in range(q.shape[0]):
        ok = (k_seq == q_seq[t]) & (k_pos <= q_pos[t])
        if window is not None:
            ok &= k_pos > q_pos[t] - window
        if not ok.any():
            continue
        for h in range(q.shape[1]):
            keys, values = k[ok, h // group], v[ok, h // group]
            s = keys @ q[t, h] * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            out[t, h] = torch.softmax(s, 0) @ values
    return out


def _case(seed: int, num_q_heads: int = 4, num_kv_heads: int = 2):
    g = torch.Generator().manual_seed(seed)
    # Two requests: 9 and 5 tokens; queries are each request's last 4 and 2 tokens.
    k_seq = torch.tensor([0] * 9 + [1] * 5)
    k_pos = torch.tensor([*range(9), *range(5)])
    q_idx = torch.tensor([5, 6, 7, 8, 12, 13])
    k = torch.randn(14, num_kv_heads, 8, generator=g)
    v = torch.randn(14, num_kv_heads, 8, generator=g)
    q = torch.randn(6, num_q_heads, 8, generator=g)
    return q, k, v, k_pos[q_idx], k_pos, k_seq[q_idx], k_seq


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("num_shards", [1, 2, 4])
def test_shards_merge_to_full_attention(window, softcap, num_shards) -> None:
    """Keys dealt round-robin to 1, 2 or 4 shards (some empty for a query) merge exactly."""
    q, k, v, q_pos, k_pos, q_seq, k_seq = _case(num_shards)
    outs, lses = [], []
    for shard in range(num_shards):
        keep = torch.arange(k.shape[0]) % num_shards == shard
        o, lse = partial_attention(
            q, k[keep], v[keep], q_pos, k_pos[keep], scale=0.3, query_seq=q_seq,
            key_seq=k_seq[keep], sliding_window=window, softcap=softcap,
        )  # fmt: skip
        outs.append(o)
        lses.append(lse)
    merged, _ = merge_partials(torch.stack(outs), torch.stack(lses))
    expected = _reference(q, k, v, q_pos, k_pos, q_seq, k_seq, 0.3, window, softcap)
    torch.testing.assert_close(merged, expected, atol=1e-6, rtol=1e-5)


def test_a_shard_with_no_key_has_minus_infinite_lse_and_weight_zero() -> None:
    """An empty shard gives lse -inf; garbage (NaN) in its output does not reach the merge."""
    q, k, v, q_pos, k_pos, q_seq, k_seq = _case(0)
    empty = k[:0]
    o_empty, lse_empty = partial_attention(
        q, empty, empty, q_pos, k_pos[:0], scale=0.3, query_seq=q_seq, key_seq=k_seq[:0]
    )
    assert torch.isneginf(lse_empty).all()
    assert (o_empty == 0).all()
    full, lse = partial_attention(q, k, v, q_pos, k_pos, scale=0.3, query_seq=q_seq, key_seq=k_seq)
    garbage = torch.full_like(full, float("nan"))
    merged, merged_lse = merge_partials(torch.stack([garbage, full]), torch.stack([lse_empty, lse]))
    torch.testing.assert_close(merged, full)
    torch.testing.assert_close(merged_lse, lse)


def test_a_query_no_shard_attends_gets_zero_not_nan() -> None:
    """Every shard -inf for a query: output 0 and lse -inf."""
    outs = torch.randn(3, 2, 4, 8)
    lses = torch.full((3, 2, 4), float("-inf"))
    merged, lse = merge_partials(outs, lses)
    assert (merged == 0).all()
    assert torch.isneginf(lse).all()


def test_merged_lse_is_the_lse_of_all_keys() -> None:
    """The merged lse equals the one-shard lse, so merges can be nested."""
    q, k, v, q_pos, k_pos, q_seq, k_seq = _case(3)
    _, whole = partial_attention(q, k, v, q_pos, k_pos, scale=0.5, query_seq=q_seq, key_seq=k_seq)
    halves = [
        partial_attention(
            q, k[s], v[s], q_pos, k_pos[s], scale=0.5, query_seq=q_seq, key_seq=k_seq[s]
        )
        for s in (slice(0, 7), slice(7, None))
    ]
    outs, lses = (torch.stack([h[i] for h in halves]) for i in (0, 1))
    _, lse = merge_partials(outs, lses)
    finite = torch.isfinite(whole)
    torch.testing.assert_close(lse[finite], whole[finite])


def test_shapes_that_disagree_are_refused() -> None:
    """A lse without the outputs' shape, or a seq tensor alone, names the problem."""
    with pytest.raises(KernelInputError, match="lses"):
        merge_partials(torch.zeros(2, 3, 4, 8), torch.zeros(2, 3))
    q, k, v, q_pos, k_pos, q_seq, _ = _case(0)
    with pytest.raises(KernelInputError, match="query_seq and key_seq"):
        partial_attention(q, k, v, q_pos, k_pos, scale=1.0, query_seq=q_seq)


def test_queries_that_read_no_key_of_the_shard_are_skipped_exactly() -> None:
    """A shard of request 0's last two keys: earlier queries and request 1's get 0 and
    -inf; the others match attention over those two keys alone."""
    q, k, v, q_pos, k_pos, q_seq, k_seq = _case(5)
    shard = slice(7, 9)
    out, lse = partial_attention(
        q, k[shard], v[shard], q_pos, k_pos[shard], scale=0.3, query_seq=q_seq,
        key_seq=k_seq[shard],
    )  # fmt: skip
    reads = (q_seq == 0) & (q_pos >= 7)
    assert torch.isneginf(lse[~reads]).all() and (out[~reads] == 0).all()
    expected = _reference(q, k[shard], v[shard], q_pos, k_pos[shard], q_seq, k_seq[shard],
                          0.3, None, None)  # fmt: skip
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_a_causal_square_shard_matches_the_reference(softcap) -> None:
    """Queries and keys at the same positions (a rank's own chunk): causal, exactly."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(12, h, 8, generator=g) for h in (4, 2, 2))
    pos, seq = torch.arange(12), torch.zeros(12, dtype=torch.long)
    out, lse = partial_attention(q, k, v, pos, pos, scale=0.4, softcap=softcap)
    torch.testing.assert_close(
        out, _reference(q, k, v, pos, pos, seq, seq, 0.4, None, softcap), atol=1e-6, rtol=1e-5
    )
    assert torch.isfinite(lse).all()
