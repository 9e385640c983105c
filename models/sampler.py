"""Pick the next token of each request from its logits.

Per row, in vLLM's order::

    structured output   tokens the request's grammar forbids -> -inf   (models/structured.py)
    min_tokens, logit_bias, repetition/frequency/presence penalties     (models/penalties.py)
    greedy              argmax
    otherwise           / temperature, min_p, top_k, top_p, then one draw

A request with a seed draws from a generator seeded by ``(seed, output_index)``: the
token at each output position depends only on the seed and the logits, so the same seed
gives the same tokens whatever else runs in the batch, and a request recomputed after
preemption draws them again. Requests without a seed share the sampler's own generator.

Rows that ask for none of the per-request processing (``params.needs_processing``
false, no min_tokens ban due) cost what they did before it existed: greedy ones share one
argmax over the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tokenizers import Tokenizer

from hybridkv.errors import HybridKVError
from hybridkv.models.penalties import process_logits
from hybridkv.models.structured import GrammarMasks
from hybridkv.scheduler.batch import StepRequest
from hybridkv.scheduler.params import SamplingParams

_MASK64 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # spreads consecutive output indices over the seed space


class StructuredOutputUnavailableError(HybridKVError):
    """A request asks for structured output from a sampler that has no tokenizer."""


def position_seed(seed: int, output_index: int) -> int:
    """A generator seed for one output position of a seeded request."""
    return (seed * 1_000_003 + (output_index + 1) * _GOLDEN) & _MASK64


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p, on one row of float32 logits.

    Tokens cut away get ``-inf``; the most likely token always survives.
    """
    # Shift the top logit to 0 first: a tiny temperature then sends the others to -inf
    # instead of overflowing them all to inf (NaN probabilities failing the whole step).
    logits = (logits - logits.max()) / params.temperature
    if params.min_p > 0.0:
        # p(t) < min_p * p(top) with the top logit at 0 is exp(logit) < min_p.
        logits = logits.masked_fill(logits.exp() < params.min_p, float("-inf"))
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p.
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= params.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    """Samples one token per row of logits, per the row's request.

    Args:
        eos_token_ids: Tokens withheld while a request is under ``min_tokens``, and the
            ones a finished grammar allows.
        seed: Seed of the generator shared by unseeded requests (random if None).
    """

    def __init__(self, *, eos_token_ids: Sequence[int] = (), seed: int | None = None) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self._shared = torch.Generator(device="cpu")
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed)
        self.grammars: GrammarMasks | None = None

    def enable_structured_output(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        """Read the vocabulary for grammar masks now (seconds for a large one) rather
        than in the first step that needs them."""
        if self.grammars is None or self.grammars.vocab_size != vocab_size:
            self.grammars = GrammarMasks(tokenizer, vocab_size, self.eos_token_ids)

    def sample(
        self,
        logits: torch.Tensor,
        requests: Sequence[StepRequest],
        *,
        tokenizer: Tokenizer | None = None,
    ) -> list[int]:
        """One token per row.

        Args:
            logits: ``[rows, vocab]``, any device; sampling runs in float32 on the CPU so
                that seeded draws do not depend on the device.
            requests: Per row, the request it samples for (its params, its output index,
                its tokens so far).
            tokenizer: The model's tokenizer, needed once by the first request with
                structured output (unless :meth:`enable_structured_output` ran).

        Raises:
            StructuredOutputUnavailableError: a request asks for structured output and
                no tokenizer was ever given.
        """
        rows = logits.detach().to("cpu", torch.float32)
        # Greedy rows with nothing to change share one argmax; the others go row by row.
        plain = [
            r.params.is_greedy
            and not r.params.needs_processing
            and r.output_index >= r.params.min_tokens
            for r in requests
        ]
        out = [0] * len(plain)
        greedy = [i for i, ok in enumerate(plain) if ok]
        if greedy:
            tokens = torch.argmax(rows[greedy] if len(greedy) < len(plain) else rows, dim=-1)
            for i, token in zip(greedy, tokens.tolist(), strict=True):
                out[i] = token
        for i, ok in enumerate(plain):
            if not ok:
                out[i] = self._sample_row(rows[i], requests[i], tokenizer)
        return out

    def _sample_row(
        self, row: torch.Tensor, request: StepRequest, tokenizer: Tokenizer | None
    ) -> int:
        params = request.params
        raw = row
        row = process_logits(row, request, self.eos_token_ids)
        if params.structured_output is not None:
            mask = self._grammar_masks(row.shape[0], tokenizer).logit_mask(request)
            row = row + mask
            if request.output_index < params.min_tokens and not torch.isfinite(row.max()):
                # min_tokens banned all the grammar allows (EOS at its end): it wins.
                row = raw + mask
        if params.is_greedy:
            return int(torch.argmax(row))
        probs = filter_logits(row, params).softmax(-1)
        if params.seed is None:
            generator = self._shared
        else:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(position_seed(params.seed, request.output_index))
        return int(torch.multinomial(probs, 1, generator=generator))

    def _grammar_masks(self, vocab_size: int, tokenizer: Tokenizer | None) -> GrammarMasks:
        if self.grammars is None or self.grammars.vocab_size != vocab_size:
            if tokenizer is None:
                raise StructuredOutputUnavailableError(
                    "a request asks for structured output, and this sampler has no tokenizer "
                    "to build grammar masks from"
                )
            self.enable_structured_output(tokenizer, vocab_size)
        assert self.grammars is not None
        return self.grammars
