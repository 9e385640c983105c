"""Pick the next token of each request from its logits.

Greedy is the argmax. Otherwise logits are divided by the temperature, cut to the top k
and to the top-p nucleus, and one token is drawn. A request with a seed draws from a
generator seeded by ``(seed, output_index)``: the token at each output position depends
only on the seed and the logits, so the same seed gives the same tokens whatever else
runs in the batch, and a request recomputed after preemption draws them again.
Requests without a seed share the sampler's own generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridkv.scheduler.params import SamplingParams

_MASK64 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # spreads consecutive output indices over the seed space


def position_seed(seed: int, output_index: int) -> int:
    """A generator seed for one output position of a seeded request."""
    return (seed * 1_000_003 + (output_index + 1) * _GOLDEN) & _MASK64


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p, on one row of float32 logits.

    Tokens cut away get ``-inf``; the most likely token always survives.
    """
    # Shift the top logit to 0 first: a tiny temperature then sends the others to -inf
    # instead of overflowing them all to inf (NaN probabilities failing the whole step).
    logits = (logits - logits.max()) / params.temperature
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
    """Samples one token per row of logits, per the row's :class:`SamplingParams`."""

    def __init__(self, *, eos_token_ids: Sequence[int] = (), seed: int | None = None) -> None:
        """Args:
        eos_token_ids: Tokens withheld while a request is under ``min_tokens``.
        seed: Seed of the generator shared by unseeded requests (random if None).
        """
        self.eos_token_ids = tuple(eos_token_ids)
        self._shared = torch.Generator(device="cpu")
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        output_indices: Sequence[int],
    ) -> list[int]:
        """One token per row.

        Args:
            logits: ``[rows, vocab]``, any device; sampling runs in float32 on the CPU so
                that seeded draws do not depend on the device.
            params: Per row, the request's parameters.
            output_indices: Per row, tokens the request generated before this one.
        """
        rows = logits.detach().to("cpu", torch.float32)
        # Greedy rows with nothing to ban share one argmax; the others go row by row.
        plain = [
            p.is_greedy and index >= p.min_tokens
            for p, index in zip(params, output_indices, strict=True)
        ]
        out = [0] * len(plain)
        greedy = [i for i, ok in enumerate(plain) if ok]
        if greedy:
            tokens = torch.argmax(rows[greedy] if len(greedy) < len(plain) else rows, dim=-1)
            for i, token in zip(greedy, tokens.tolist(), strict=True):
                out[i] = token
        for i, ok in enumerate(plain):
            if not ok:
                out[i] = self._sample_row(rows[i], params[i], output_indices[i])
        return out

    def _sample_row(self, row: torch.Tensor, params: SamplingParams, output_index: int) -> int:
        if output_index < params.min_tokens:
            banned = [t for t in (*self.eos_token_ids, *params.stop_token_ids) if t < row.shape[0]]
            if banned:
                row = row.clone()
                row[banned] = float("-inf")
        if params.is_greedy:
            return int(torch.argmax(row))
        probs = filter_logits(row, params).softmax(-1)
        if params.seed is None:
            generator = self._shared
        else:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(position_seed(params.seed, output_index))
        return int(torch.multinomial(probs, 1, generator=generator))
