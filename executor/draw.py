"""One draw for all sampled rows: temperature, min-p, top-k, top-p, then inverse CDF.

The rows' filters are applied together, and each row draws its token from one uniform
number ``u``: the token is the first, in token-id order, whose cumulative probability
exceeds ``u`` times the total (so the same ``u`` picks the same token whichever path below
a row takes). Where ``u`` comes from (a per-request seeded generator or the sampler's shared one)
is the caller's business, so a seeded row's token depends on its logits and its ``u``
alone, never on its neighbours.

Top-k and top-p avoid sorting the vocabulary (262,144 logits for Gemma 3)::

    candidates   topk(logits, K), sorted          K = max top_k + 1, else a guess
    top-k        keep candidate positions < top_k
    top-p        cumulative mass over the sorted candidates; exact once the candidates
                 already reach top_p (every token beyond them is dropped too)
    the rest     a row whose top-k boundary is a tie, or whose nucleus is wider than the
                 widest guess, takes :func:`filter_logits` (a full sort), row by row

A zero-probability token is never drawn: the cumulative sum is flat over it, and the
search returns the first position whose sum exceeds the target.

All of it runs on the logits' device. :func:`draw_rows` reads nothing back: it returns
the tokens and which rows the first guess left undecided, for the caller to read back
with its other ids in one copy (``executor/host_copy.py``); :func:`settle` draws those
rows again, reading back each round (rare).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hybridkv.executor.host_copy import to_host_list
from hybridkv.scheduler.params import SamplingParams

# Probabilities per block of the two-level inverse CDF.
_BLOCK = 1024
# Candidate counts tried for rows with top-p and no top-k, before a full sort.
_NUCLEUS_GUESSES = (1024, 16384)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p, on one row of float32 logits.

    The reference the batched path must agree with, and its fallback. Tokens cut away get
    ``-inf``; the most likely token always survives.
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


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` ``[n, V]`` (unnormalised is fine), the position drawn by ``u``.

    Two levels, so no float64 pass over the whole vocabulary (a float64 cumulative sum of
    262,144 probabilities costs ten times the float32 softmax): the block is found from
    float32 block sums accumulated in float64, the position by a float64 cumulative sum
    inside that block alone.
    """
    rows, vocab = probs.shape
    block = min(vocab, _BLOCK)
    padded = torch.nn.functional.pad(probs, (0, -vocab % block)).view(rows, -1, block)
    block_cdf = padded.sum(-1).to(torch.float64).cumsum(-1)
    target = uniforms.to(torch.float64) * block_cdf[:, -1]
    chosen = torch.minimum(
        _first_above(block_cdf, target), _first_above(block_cdf, block_cdf[:, -1], strict=False)
    )
    before = torch.where(
        chosen > 0, block_cdf.gather(1, (chosen - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0
    )
    inside = padded[torch.arange(rows), chosen].to(torch.float64).cumsum(-1)
    # Rounding between the two sums can leave the rest at or past the block's total: take
    # the block's last token with mass then.
    position = torch.minimum(
        _first_above(inside, target - before), _first_above(inside, inside[:, -1], strict=False)
    )
    return chosen * block + position


def _first_above(cdf: torch.Tensor, target: torch.Tensor, *, strict: bool = True) -> torch.Tensor:
    """Per row, the first position whose cumulative value is above (or at) ``target``."""
    column = target.unsqueeze(-1).contiguous()
    return torch.searchsorted(cdf.contiguous(), column, right=strict).squeeze(-1)


def draw(
    logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: torch.Tensor
) -> list[int]:
    """One token per row of float32 ``logits`` ``[n, V]``, each drawn with its ``u`` in [0, 1)."""
    tokens, undecided = draw_rows(logits, params, uniforms)
    both = to_host_list(torch.cat([tokens, undecided.long()]))
    return settle(logits, params, uniforms, both[: len(params)], both[len(params) :])


def draw_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`draw` without reading anything back: per row, on the device of ``logits``,
    the token drawn and whether it is undecided (its candidates could not settle it: a
    tie at the top-k boundary, or a nucleus wider than the first guess). :func:`settle`
    draws the undecided rows again."""
    vocab = logits.shape[-1]
    scaled = _scaled(logits, params)
    tokens = torch.zeros(len(params), dtype=torch.long, device=logits.device)
    undecided = torch.zeros(len(params), dtype=torch.bool, device=logits.device)
    truncated = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    whole = [i for i in range(len(params)) if i not in set(truncated)]
    if whole:
        tokens[whole] = inverse_cdf(scaled[whole].softmax(-1), uniforms[whole])
    if truncated:
        guess = _NUCLEUS_GUESSES[0]
        tokens[truncated], undecided[truncated] = _draw_candidates(
            scaled, params, uniforms, truncated, guess
        )
    return tokens, undecided


def settle(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    uniforms: torch.Tensor,
    tokens: list[int],
    undecided: Sequence[int],
) -> list[int]:
    """``tokens`` (from :func:`draw_rows`, on the host) with each undecided row drawn again:
    from wider candidates, then by a full sort. Rare; each round reads its tokens back."""
    pending = [i for i, flag in enumerate(undecided) if flag]
    if not pending:
        return tokens
    tokens, scaled = list(tokens), _scaled(logits, params)
    for guess in _NUCLEUS_GUESSES[1:]:
        if not pending:
            break
        drawn, left = _draw_candidates(scaled, params, uniforms, pending, guess)
        both = to_host_list(torch.cat([drawn, left.long()]))
        for n, i in enumerate(pending):
            tokens[i] = both[n]
        pending = [i for n, i in enumerate(pending) if both[len(pending) + n]]
    for i in pending:
        # A tie at the top-k boundary or a nucleus wider than every guess: sort the row.
        row = filter_logits(logits[i], params[i]).softmax(-1)
        tokens[i] = to_host_list(inverse_cdf(row.unsqueeze(0), uniforms[i : i + 1]))[0]
    return tokens


def _scaled(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Each row's logits after its temperature and min-p, the top one at 0."""
    temperature = torch.tensor(
        [p.temperature for p in params], dtype=logits.dtype, device=logits.device
    )
    scaled = (logits - logits.amax(-1, keepdim=True)) / temperature.unsqueeze(-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)
        scaled = scaled.masked_fill(scaled.exp() < min_p.unsqueeze(-1), float("-inf"))
    return scaled


def _draw_candidates(
    scaled: torch.Tensor,
    params: Sequence[SamplingParams],
    uniforms: torch.Tensor,
    rows: list[int],
    guess: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``rows``, the token drawn from its top candidates, and whether those
    could not decide it (the token is then meaningless)."""
    vocab, device = scaled.shape[-1], scaled.device
    ks = [params[i].top_k if 0 < params[i].top_k < vocab else 0 for i in rows]
    top_k = torch.tensor(ks, device=device)
    top_p = torch.tensor([params[i].top_p for i in rows], dtype=torch.float64, device=device)
    width = min(vocab, max(max(ks) + 1, guess if 0 in ks else 0))
    values, indices = torch.topk(scaled[rows], width, dim=-1, sorted=True)
    # Ties in a canonical order (lower token id first), whatever the width: a seeded row
    # then draws the same token beside any neighbours (bfloat16 logits tie often).
    indices, by_id = indices.sort(-1)
    values, by_value = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    indices = indices.gather(1, by_value)
    positions = torch.arange(width, device=device)
    has_k = top_k > 0
    # Keep all of a tie at the k-th logit, as filter_logits does: such rows fall back.
    kth = values.gather(1, (top_k - 1).clamp(min=0).unsqueeze(-1))
    after = values.gather(1, top_k.clamp(max=width - 1).unsqueeze(-1))
    tied = has_k & (top_k < width) & (after == kth).squeeze(-1) & torch.isfinite(kth).squeeze(-1)
    values = values.masked_fill(has_k.unsqueeze(-1) & (positions >= top_k.unsqueeze(-1)), -math.inf)
    # Top-p's mass: over the candidates when top-k bounds them, else over the whole row.
    values64 = values.to(torch.float64)
    whole_mass = torch.logsumexp(scaled[rows], -1, keepdim=True).to(torch.float64)
    log_total = torch.where(
        has_k.unsqueeze(-1), torch.logsumexp(values64, -1, keepdim=True), whole_mass
    )
    probs = (values64 - log_total).exp()
    before = probs.cumsum(-1) - probs
    drop = before >= top_p.unsqueeze(-1)
    drop[:, 0] = False
    # Without top-k the candidates decide only if the nucleus ends inside them.
    undecided = ~has_k & (top_p < 1.0) & ~drop[:, -1] & (width < vocab)
    probs = values.masked_fill(drop, -math.inf).softmax(-1)
    # Draw in token-id order, as the full-vocabulary path does: the same u picks the
    # same token whichever path a row takes.
    indices, by_id = indices.sort(-1)
    picked = inverse_cdf(probs.gather(1, by_id), uniforms[rows])
    return indices.gather(1, picked.unsqueeze(-1)).squeeze(-1), tied | undecided
