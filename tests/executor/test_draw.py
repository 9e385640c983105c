"""The batched draw: the distribution it samples, and the filters it shares with the
row-by-row reference (``filter_logits``) on small and wide vocabularies."""

from __future__ import annotations

import pytest
import torch

from hybridkv.executor.draw import draw, filter_logits, inverse_cdf
from hybridkv.executor.sampler import Sampler
from hybridkv.scheduler.batch import StepRequest
from hybridkv.scheduler.params import SamplingParams

# Chi-square critical value for 5 degrees of freedom at p = 0.001.
CHI2_5_DOF_P001 = 20.52


def sampled(rid: str, params: SamplingParams, output_index: int = 0) -> StepRequest:
    return StepRequest(
        request_id=rid,
        token_ids=[0],
        start_position=0,
        block_tables=[],
        sample=True,
        params=params,
        output_index=output_index,
        all_token_ids=(),
    )


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def reference(row: torch.Tensor, params: SamplingParams, u: float) -> int:
    """The token the row-by-row path draws with ``u``: filter_logits, softmax, inverse CDF."""
    probs = filter_logits(row, params).softmax(-1)
    return int(inverse_cdf(probs.unsqueeze(0), torch.tensor([u], dtype=torch.float64))[0])


def test_draws_follow_the_softmax():
    """20,000 draws from six tokens: counts pass a chi-square test against the softmax."""
    probs = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.07, 0.03])
    n = 20_000
    logits = probs.log().expand(n, -1).contiguous()
    uniforms = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens = torch.tensor(draw(logits, [SamplingParams()] * n, uniforms))
    assert (
        chi_square(torch.bincount(tokens, minlength=6).double(), probs.double()) < CHI2_5_DOF_P001
    )


def test_sampler_draws_follow_the_filtered_distribution():
    """Through the sampler's shared generator, with temperature and top-k in one batch:
    each row's counts pass a chi-square test against its own filtered softmax."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -9.0, -9.0]])
    hot = SamplingParams(temperature=2.0)
    cut = SamplingParams(top_k=6, temperature=0.8)
    counts = {0: torch.zeros(8), 1: torch.zeros(8)}
    sampler = Sampler(seed=3)
    rows = [sampled("a", hot), sampled("b", cut)]
    for _ in range(6000):
        first, second = sampler.sample(torch.cat([logits, logits]), rows)
        counts[0][first] += 1
        counts[1][second] += 1
    for row, params in ((0, hot), (1, cut)):
        probs = filter_logits(logits[0], params).softmax(-1).double()
        live = probs > 0
        assert counts[row][~live].sum() == 0
        top6 = torch.topk(probs, 6).indices
        assert chi_square(counts[row][top6].double(), probs[top6]) < CHI2_5_DOF_P001


CASES = [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(top_p=0.6),
    SamplingParams(temperature=1.3, top_k=40, top_p=0.8),
    SamplingParams(min_p=0.05, top_p=0.95),
    SamplingParams(temperature=0.5, min_p=0.2, top_k=3),
]


@pytest.mark.parametrize("vocab", [50, 3000, 40_000])
def test_batched_filters_match_the_reference(vocab: int):
    """Rows with mixed top-k / top-p / min-p in one batch draw, for the same uniforms, the
    tokens the full-sort reference draws: on a small vocabulary, one wider than the first
    nucleus guess, and one wider than every guess (flat logits, top_p close to 1)."""
    gen = torch.Generator().manual_seed(vocab)
    params = [*CASES, SamplingParams(top_p=0.99, temperature=4.0)]
    logits = torch.randn(len(params), vocab, generator=gen)
    for _ in range(20):
        uniforms = torch.rand(len(params), generator=gen, dtype=torch.float64)
        got = draw(logits, params, uniforms)
        want = [reference(logits[i], p, float(uniforms[i])) for i, p in enumerate(params)]
        assert got == want


def test_a_tie_at_the_top_k_boundary_keeps_all_tied_tokens():
    """top_k=2 over logits 3, 1, 1, 0 keeps both tokens tied at the boundary, as
    filter_logits does."""
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    params = SamplingParams(top_k=2, temperature=10.0)
    drawn = {draw(logits, [params], torch.tensor([u / 100]))[0] for u in range(100)}
    assert drawn == {0, 1, 2}


def test_a_seeded_row_draws_the_same_token_beside_wider_neighbours():
    """The candidate width grows with the batch's largest top_k; a seeded row with tied
    logits still draws the same tokens (ties are ordered by token id)."""
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    row = logits.float()
    seeded = SamplingParams(top_p=0.9, seed=77, temperature=3.0)
    wide = SamplingParams(top_k=400)
    sampler = Sampler()
    alone = [sampler.sample(row, [sampled("a", seeded, i)])[0] for i in range(30)]
    batch = torch.cat([row.flip(-1), row])
    mixed = [
        sampler.sample(batch, [sampled("b", wide), sampled("a", seeded, i)])[1] for i in range(30)
    ]
    assert alone == mixed
    assert len(set(alone)) > 1


def test_zero_probability_tokens_are_never_drawn():
    """A u at the very top of [0, 1) still lands on a token with mass."""
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    assert int(inverse_cdf(probs, torch.tensor([1.0 - 2**-53], dtype=torch.float64))[0]) == 1
    assert int(inverse_cdf(probs, torch.tensor([0.0], dtype=torch.float64))[0]) == 0
