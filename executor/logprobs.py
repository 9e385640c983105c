"""Log-probabilities of chosen tokens and the most likely ones, from logits.

They are the log-softmax of the model's logits (soft-capped where the model caps them),
before any temperature, top-k or top-p: what the model thinks, whatever the sampler then
did. That is what vLLM returns by default, and what transformers' ``log_softmax`` of its
logits gives, so the two can be compared directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hybridkv.scheduler.outputs import TokenLogprobs

# Rows of prompt logits computed at once: a 262k vocabulary makes each row 1 MiB.
PROMPT_LOGITS_ROWS = 256


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """Per row of ``[rows, vocab]`` logits: ``token_ids[row]``'s log-probability and rank,
    and the ``num_top[row]`` most likely tokens.

    The rank counts the tokens at least as likely as the chosen one (1 for the top).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device)[:, None]
    chosen = logprobs.gather(1, index)
    ranks = (logprobs >= chosen).sum(-1).tolist()
    width = max(num_top, default=0)
    if width:
        top_values, top_ids = logprobs.topk(width, dim=-1)
        values, ids = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(
            token_id=int(token),
            logprob=float(value),
            rank=int(rank),
            top=tuple(zip(ids[row][:k], values[row][:k], strict=True)) if k else (),
        )
        for row, (token, value, rank, k) in enumerate(
            zip(token_ids, chosen[:, 0].tolist(), ranks, num_top, strict=True)
        )
    ]


def prompt_logprobs(
    hidden: torch.Tensor,
    token_ids: Sequence[int],
    num_top: int,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[TokenLogprobs, ...]:
    """Log-probabilities of ``token_ids[i]`` from the hidden state of row ``i``.

    Logits are computed a slice of rows at a time, so a long prompt never holds all of
    its ``[len, vocab]`` logits at once.
    """
    out: list[TokenLogprobs] = []
    for start in range(0, len(token_ids), PROMPT_LOGITS_ROWS):
        stop = min(start + PROMPT_LOGITS_ROWS, len(token_ids))
        logits = compute_logits(hidden[start:stop])
        out.extend(token_logprobs(logits, token_ids[start:stop], [num_top] * (stop - start)))
    return tuple(out)
