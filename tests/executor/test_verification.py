"""Verifying proposals: greedy keeps the text without speculation; sampled, every emitted
token follows the target's distribution whatever the draft proposed (chi-square bounds on
a 5-token vocabulary, seeded, so a run is the same every time)."""

from __future__ import annotations

import pytest
import torch

from hybridkv.executor.verification import verify_greedy, verify_sampled

P = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05], dtype=torch.float64)
# Chi-square with 4 degrees of freedom: exceeded with probability 0.001.
CHI2_4_AT_0_001 = 18.47
DRAWS = 20_000


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_accepts_while_it_agrees_and_adds_its_own_token() -> None:
    assert verify_greedy([3, 4, 9, 2], [3, 4, 5]) == [3, 4, 9]
    assert verify_greedy([3, 4, 5, 2], [3, 4, 5]) == [3, 4, 5, 2]  # all kept, and the bonus
    assert verify_greedy([7, 1], [8]) == [7]
    assert verify_greedy([6], []) == [6]
    with pytest.raises(ValueError, match="2 target distributions for 2 proposals"):
        verify_greedy([1, 2], [1, 2])


@pytest.mark.parametrize("proposal", [0, 4])
def test_a_deterministic_proposal_leaves_the_first_token_distributed_as_the_target(
    proposal: int,
) -> None:
    generator = torch.Generator().manual_seed(proposal)
    targets = torch.stack([P, P])
    counts = torch.zeros(5, dtype=torch.float64)
    accepted = 0
    for _ in range(DRAWS):
        out = verify_sampled(targets, [proposal], generator=generator)
        counts[out[0]] += 1
        accepted += out[0] == proposal and len(out) == 2
    assert chi_square(counts, P) < CHI2_4_AT_0_001
    # Accepted with the target's probability of the proposal (binomial, 5 sigma).
    sigma = (DRAWS * P[proposal] * (1 - P[proposal])) ** 0.5
    assert abs(accepted - DRAWS * float(P[proposal])) < 5 * sigma


def test_a_draft_distribution_leaves_every_position_distributed_as_the_target() -> None:
    generator = torch.Generator().manual_seed(1)
    q = torch.tensor([0.05, 0.05, 0.10, 0.30, 0.50], dtype=torch.float64)  # far from P
    targets, drafts = torch.stack([P, P, P]), torch.stack([q, q])
    first = torch.zeros(5, dtype=torch.float64)
    second = torch.zeros(5, dtype=torch.float64)
    for _ in range(DRAWS):
        proposed = torch.multinomial(drafts, 1, generator=generator).flatten().tolist()
        out = verify_sampled(targets, proposed, drafts, generator=generator)
        assert 1 <= len(out) <= 3
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert chi_square(first, P) < CHI2_4_AT_0_001
    assert chi_square(second, P) < CHI2_4_AT_0_001


def test_a_token_the_target_forbids_is_never_accepted_or_drawn() -> None:
    masked = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0], dtype=torch.float64)
    generator = torch.Generator().manual_seed(2)
    for _ in range(200):
        out = verify_sampled(torch.stack([masked, masked]), [3], generator=generator)
        assert out[0] in (0, 1) and len(out) == 1


def test_a_seeded_generator_repeats_the_step() -> None:
    targets = torch.stack([P, P, P])

    def run() -> list[list[int]]:
        generator = torch.Generator().manual_seed(7)
        return [verify_sampled(targets, [0, 1], generator=generator) for _ in range(50)]

    assert run() == run()
