"""The sampler: greedy, filters, and per-request seeds that survive batching and recompute."""

from __future__ import annotations

import torch

from hybridkv.models.sampler import Sampler, filter_logits
from hybridkv.scheduler.params import SamplingParams


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, 50, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_the_argmax():
    """Temperature 0 picks the largest logit of each row."""
    logits = _logits(3)
    greedy = SamplingParams(temperature=0.0)
    assert Sampler(seed=0).sample(logits, [greedy] * 3, [0, 0, 0]) == logits.argmax(-1).tolist()


def test_same_seed_gives_same_tokens_whatever_the_batch():
    """A seeded request draws the same tokens alone or between other requests."""
    logits = _logits(1)[0]
    seeded = SamplingParams(seed=1234)
    other = SamplingParams(seed=None)
    alone = [Sampler(seed=1).sample(logits[None], [seeded], [i])[0] for i in range(20)]
    batch = torch.stack([logits.flip(0), logits, logits * 2])
    mixed = [Sampler(seed=2).sample(batch, [other, seeded, other], [5, i, 9])[1] for i in range(20)]
    assert alone == mixed


def test_different_seeds_give_different_tokens():
    """Two seeds over 20 draws from a flat distribution do not produce one sequence."""
    logits = torch.zeros(1, 50)
    draws = {
        seed: [Sampler().sample(logits, [SamplingParams(seed=seed)], [i])[0] for i in range(20)]
        for seed in (1, 2)
    }
    assert draws[1] != draws[2]


def test_unseeded_requests_follow_the_sampler_seed():
    """Requests without a seed share a generator seeded by the sampler's own seed."""
    logits = torch.zeros(1, 50)
    params = [SamplingParams()]
    first, second = Sampler(seed=7), Sampler(seed=7)
    assert [first.sample(logits, params, [0])[0] for _ in range(10)] == [
        second.sample(logits, params, [0])[0] for _ in range(10)
    ]


def test_top_k_keeps_only_the_k_largest():
    """With top_k=3 only the three largest logits can ever be drawn."""
    logits = _logits(1, 3)
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    params = SamplingParams(top_k=3, temperature=5.0, seed=0)
    drawn = {Sampler().sample(logits, [params], [i])[0] for i in range(200)}
    assert drawn <= allowed
    assert len(drawn) > 1


def test_top_p_keeps_the_smallest_nucleus():
    """Probabilities 0.5, 0.3, 0.2 with top_p=0.7 keep the first two tokens only."""
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    kept = filter_logits(logits, SamplingParams(top_p=0.7))
    assert torch.isfinite(kept).tolist() == [True, True, False]


def test_top_p_always_keeps_the_top_token():
    """A top_p below the largest probability still leaves one token."""
    logits = torch.tensor([0.6, 0.4]).log()
    kept = filter_logits(logits, SamplingParams(top_p=0.1))
    assert torch.isfinite(kept).tolist() == [True, False]


def test_min_tokens_withholds_eos():
    """Under min_tokens the end-of-sequence token is never picked, even when it is the argmax."""
    logits = torch.zeros(1, 10)
    logits[0, 2] = 100.0
    sampler = Sampler(eos_token_ids=[2])
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=5)
    assert sampler.sample(logits, [params], [2])[0] != 2
    assert sampler.sample(logits, [params], [3])[0] == 2


def test_tiny_temperature_samples_the_top_token():
    """A temperature small enough to overflow float32 logits still draws the argmax."""
    logits = _logits(2)
    tiny = SamplingParams(temperature=1e-40, seed=7)
    assert Sampler(seed=0).sample(logits, [tiny] * 2, [0, 0]) == logits.argmax(-1).tolist()
