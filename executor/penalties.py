"""Logit changes that read the request's tokens: min-tokens bans, logit bias, penalties.

They run on one row of float32 logits before temperature, in vLLM's order (and with
OpenAI's definitions of the presence and frequency penalties)::

    row = logits of the next token
    1. min_tokens   EOS and stop tokens -> -inf while fewer than min_tokens are out
    2. logit_bias   row[t] += bias[t]
    3. repetition   for t in prompt or output: row[t] / p if row[t] > 0 else row[t] * p
    4. frequency    row[t] -= frequency_penalty * count of t in the output
    5. presence     row[t] -= presence_penalty * (t in the output)

The prompt counts for the repetition penalty only, as in vLLM. The request's tokens are
counted on the host and sent to the row's device; nothing is read back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridkv.scheduler.batch import StepRequest


def ban_tokens(row: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
    """``row`` with ``token_ids`` (those inside the vocabulary) set to ``-inf``."""
    banned = [t for t in token_ids if 0 <= t < row.shape[0]]
    if not banned:
        return row
    row = row.clone()
    row[banned] = float("-inf")
    return row


def add_logit_bias(row: torch.Tensor, bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """``row`` plus each ``(token id, bias)``; ids outside the vocabulary are skipped (the
    server refuses them before a request is queued)."""
    vocab = row.shape[0]
    pairs = [(t, b) for t, b in bias if 0 <= t < vocab]
    if not pairs:
        return row
    ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=row.device)
    values = torch.tensor([b for _, b in pairs], dtype=row.dtype, device=row.device)
    return row.index_add(0, ids, values)


def apply_penalties(row: torch.Tensor, request: StepRequest) -> torch.Tensor:
    """``row`` after the request's repetition, frequency and presence penalties.

    The tokens come from ``request.all_token_ids``; its last ``request.output_index`` are
    the output.
    """
    params = request.params
    vocab = row.shape[0]
    history = request.all_token_ids
    ids = torch.tensor(history, dtype=torch.long) if history else torch.zeros(0, dtype=torch.long)
    num_outputs = request.output_index
    if params.repetition_penalty != 1.0 and len(ids):
        seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
        seen[ids[ids < vocab].to(row.device)] = True
        penalty = params.repetition_penalty
        scaled = torch.where(row > 0, row / penalty, row * penalty)
        row = torch.where(seen, scaled, row)
    if num_outputs and (params.frequency_penalty or params.presence_penalty):
        outputs = ids[len(ids) - num_outputs :]
        counts = torch.bincount(outputs[outputs < vocab], minlength=vocab).to(row.device, row.dtype)
        row = row - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    return row


def process_logits(
    row: torch.Tensor, request: StepRequest, eos_token_ids: Sequence[int]
) -> torch.Tensor:
    """Steps 1-5 above on one row (a new tensor where anything changes)."""
    params = request.params
    if request.output_index < params.min_tokens:
        row = ban_tokens(row, (*eos_token_ids, *params.stop_token_ids))
    if not params.needs_processing:
        return row
    if params.logit_bias:
        row = add_logit_bias(row, params.logit_bias)
    if params.has_penalties:
        row = apply_penalties(row, request)
    return row
