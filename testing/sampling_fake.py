"""A fake executor with logits, so the real sampler runs: temperature, top-k/p, min-p,
penalties, logit bias, logprobs and structured output behave as on a model."""

from __future__ import annotations

from typing import Any

import torch

from hybridkv.executor.sampler import Sampler
from hybridkv.scheduler import FakeExecutor, StepBatch, StepResult
from hybridkv.scheduler.batch import StepRequest
from hybridkv.scheduler.params import StructuredOutput
from hybridkv.testing.sample_tokenizers import BYTE_EOS, byte_tokenizer


class SamplingFakeExecutor(FakeExecutor):
    """The fake (pages written and checked as :class:`FakeExecutor` does), whose sampled
    positions get a row of random logits seeded by what the position's pages hold; the
    real :class:`~hybridkv.executor.sampler.Sampler` samples them.

    Meant for :func:`~hybridkv.testing.byte_tokenizer`'s vocabulary (257 ids, ``<eos>``
    256): the text served is then any bytes, as a real model's can be. Build the engine
    config with ``vocab_size=BYTE_EOS + 1`` and ``eos_token_ids=[BYTE_EOS]``.
    """

    #: It samples after the last position only: no speculative decoding.
    verifies_proposals = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sampler = Sampler(eos_token_ids=[BYTE_EOS], seed=0)
        self.tokenizer = byte_tokenizer()

    def compile_grammar(self, spec: StructuredOutput) -> None:
        """Compile ahead, as the model executor does (the server calls it off the step)."""
        self.sampler.compile_grammar(spec, self.tokenizer, BYTE_EOS + 1)

    def execute(self, batch: StepBatch) -> StepResult:
        fake = super().execute(batch)
        rows = [i for i, r in enumerate(batch.requests) if r.sample]
        if not rows:
            return fake
        logits = torch.stack([self._logits(batch.requests[i]) for i in rows])
        sampled = self.sampler.sample(
            logits, [batch.requests[i] for i in rows], tokenizer=self.tokenizer
        )
        tokens = list(fake.token_ids)
        for i, token in zip(rows, sampled, strict=True):
            tokens[i] = token
        return StepResult(token_ids=tuple(tokens), prompt_logprobs=fake.prompt_logprobs)

    def _logits(self, request: StepRequest) -> torch.Tensor:
        h = self._read(request.block_tables, request.start_position + request.num_tokens - 1)
        generator = torch.Generator().manual_seed(h & 0x7FFFFFFF)
        return torch.randn(self.vocab_size, generator=generator) * 3
