"""Log-probabilities of chosen tokens and the most likely ones, from logits.

They are the log-softmax of the model's logits (soft-capped where the model caps them),
before any temperature, top-k or top-p: what the model thinks, whatever the sampler then
did. That is what vLLM returns by default, and what transformers' ``log_softmax`` of its
logits gives, so the two can be compared directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hybridkv.executor.host_copy import to_host_rows
from hybridkv.scheduler.batch import StepRequest
from hybridkv.scheduler.outputs import TokenLogprobs

# Rows of prompt logits computed at once: a 262k vocabulary makes each row 1 MiB.
PROMPT_LOGITS_ROWS = 256


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """Per row of ``[rows, vocab]`` logits: ``token_ids[row]``'s log-probability and rank,
    and the ``num_top[row]`` most likely tokens.

    The rank counts the tokens at least as likely as the chosen one (1 for the top). All
    of it comes to the host in one copy, as float64 (exact for the ids and ranks).
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device)[:, None]
    chosen = logprobs.gather(1, index)
    columns = [chosen, (logprobs >= chosen).sum(-1, keepdim=True)]
    width = max(num_top, default=0)
    if width:
        columns.extend(logprobs.topk(width, dim=-1))  # values, then ids
    rows = to_host_rows(torch.cat([c.to(torch.float64) for c in columns], dim=1))
    return [
        TokenLogprobs(
            token_id=int(token),
            logprob=row[0],
            rank=int(row[1]),
            top=tuple(zip(map(int, row[2 + width : 2 + width + k]), row[2 : 2 + k], strict=True)),
        )
        for token, row, k in zip(token_ids, rows, num_top, strict=True)
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


def step_prompt_logprobs(
    requests: Sequence[StepRequest],
    hidden: torch.Tensor,
    query_lens: Sequence[int],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[tuple[TokenLogprobs, ...], ...] | None:
    """Per request of a step, the log-probabilities of its ``prompt_logprob_token_ids``
    from its rows of ``hidden`` (None when no request of the step asks)."""
    if not any(r.prompt_logprob_token_ids for r in requests):
        return None
    out: list[tuple[TokenLogprobs, ...]] = [()] * len(requests)
    first = 0
    for i, (request, num_tokens) in enumerate(zip(requests, query_lens, strict=True)):
        targets = request.prompt_logprob_token_ids
        if targets:
            rows = hidden[first : first + len(targets)]
            num_top = request.params.prompt_logprobs or 0
            out[i] = prompt_logprobs(rows, targets, num_top, compute_logits)
        first += num_tokens
    return tuple(out)


def emitted_logprobs(
    requests: Sequence[StepRequest],
    rows: list[int],
    logits: torch.Tensor,
    firsts: list[int],
    emitted: dict[int, list[int]],
) -> tuple[tuple[TokenLogprobs | None, ...] | None, tuple[tuple[TokenLogprobs, ...], ...] | None]:
    """Log-probabilities of every token a step emitted where asked: per request of the
    step, its last token's, and those of the proposals it kept before it.

    Args:
        requests: The step's requests.
        rows: The indices of those that sampled.
        logits: The rows of logits they sampled from, request after request.
        firsts: Per sampled request (and one past the last), its first row of ``logits``.
        emitted: Per sampled request (by its index in ``rows``), the tokens it emitted.
    """
    asked = [n for n, i in enumerate(rows) if requests[i].params.logprobs is not None]
    if not asked:
        return None, None
    index = [firsts[n] + j for n in asked for j in range(len(emitted[n]))]
    found = token_logprobs(
        logits[index],
        [token for n in asked for token in emitted[n]],
        [requests[rows[n]].params.logprobs or 0 for n in asked for _ in emitted[n]],
    )
    logprobs: list[TokenLogprobs | None] = [None] * len(requests)
    before: list[tuple[TokenLogprobs, ...]] = [()] * len(requests)
    at = 0
    for n in asked:
        count = len(emitted[n])
        logprobs[rows[n]] = found[at + count - 1]
        before[rows[n]] = tuple(found[at : at + count - 1])
        at += count
    has_before = any(before)
    return tuple(logprobs), tuple(before) if has_before else None
