"""Proposers for testing speculative decoding against the fake executors.

The fakes' next token is a pure function of the sequence so far
(:func:`~hybridkv.scheduler.fake.reference_tokens`), so a proposer can know the right
continuation and get a chosen share of it wrong: every verification outcome, from all
rejected to all accepted, then happens at a rate the test sets, and the outputs must
still be exactly the fake's::

    proposer = ReferenceProposer(vocab_size=50, miss=0.3, seed=1)
    async with Engine(config, fake, proposer=proposer) as engine: ...
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from hybridkv.policies.base import MemoryPolicy
from hybridkv.scheduler.fake import reference_tokens
from hybridkv.scheduler.fake_attending import attending_reference_tokens


class ReferenceProposer:
    """Proposes the fake's own continuation, each token replaced by a wrong one with
    probability ``miss``, of a random length from 1 to ``k`` (``k`` itself with
    ``random_length=False``).

    Args:
        vocab_size: The fake's vocabulary.
        miss: Chance that a proposed token is wrong.
        seed: Seeds the choices, so that a test repeats.
        random_length: Propose fewer than ``k`` tokens at random.
        attends: For :class:`~hybridkv.scheduler.fake_attending.AttendingFakeExecutor`,
            the policies its groups attend with; None for the plain fake.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        miss: float = 0.3,
        seed: int = 0,
        attends: Sequence[MemoryPolicy] | None = None,
        random_length: bool = True,
    ) -> None:
        self.vocab_size = vocab_size
        self.miss = miss
        self.attends = None if attends is None else tuple(attends)
        self._random = random.Random(seed)
        self.random_length = random_length
        self.num_proposed = 0

    def propose(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to ``k`` tokens after ``tokens``, some of them wrong."""
        if self.random_length:
            k = self._random.randint(1, k)
        if self.attends is None:
            right = reference_tokens(tokens, k, self.vocab_size)
        else:
            right = attending_reference_tokens(tokens, k, self.vocab_size, self.attends)
        self.num_proposed += k
        return tuple(
            (t + 1) % self.vocab_size if self._random.random() < self.miss else t for t in right
        )
