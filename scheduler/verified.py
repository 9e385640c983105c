"""What a verification step emits for one request, and where the request stops in it.

A request that ran ``k`` proposed tokens (speculative decoding) emits the ``a`` the
executor accepted, then the executor's own token: ``draft[:a] + [token]``. They are taken
in order, as decoding would have, and the first that ends the request ends it there: the
tokens after it are dropped. The proposals kept before the last emitted token count as
computed (the step ran them); the rest never happened::

    draft   d0 d1 d2 d3     accepted a = 2, own token t
    emits   d0 d1 t         no stop: 2 proposals computed and kept
    emits   d0              d0 ends the request: 1 kept, d1 and t dropped
"""

from __future__ import annotations

import attrs

from hybridkv.scheduler.batch import ExecutorResultError, StepRequest, StepResult
from hybridkv.scheduler.outputs import FinishReason, TokenLogprobs
from hybridkv.scheduler.request import Request


@attrs.frozen
class Verified:
    """One request's share of a verification step.

    Attributes:
        tokens: What it emits, in order, cut after a token that ends it.
        reason: Why it ends, or None.
        num_kept: Proposals that count as computed (appended and kept).
        num_accepted: Proposals the executor accepted (for the speculator's counts).
        logprobs: Per emitted token, where the request asked.
    """

    tokens: tuple[int, ...]
    reason: FinishReason | None
    num_kept: int
    num_accepted: int
    logprobs: tuple[TokenLogprobs, ...] | None


def take_verified(
    request: Request,
    item: StepRequest,
    result: StepResult,
    index: int,
    limits: tuple[frozenset[int], int],
) -> Verified | ExecutorResultError:
    """Check the executor's answer for ``request`` (entry ``index`` of ``result``) and append
    the tokens it emits to its ``all_token_ids``; an error where the answer does not fit.

    ``limits``: the end-of-sequence tokens and ``max_model_len``.
    """
    num_drafts = item.num_draft_tokens
    num_accepted = result.num_accepted[index] if result.num_accepted else 0
    if not 0 <= num_accepted <= num_drafts:
        return ExecutorResultError(f"{num_accepted} of {num_drafts} proposals accepted")
    token = result.token_ids[index]
    assert token is not None, "request_failure fails a sampling request without token"
    emitted = [*item.draft_token_ids[:num_accepted], token]
    logprobs: tuple[TokenLogprobs, ...] | None = None
    if request.params.logprobs is not None:
        found = result.logprobs[index] if result.logprobs else None
        before = result.accepted_logprobs[index] if result.accepted_logprobs else ()
        if found is None or len(before) != num_accepted:
            return ExecutorResultError("the executor returned no logprobs for it")
        logprobs = (*before, found)
    eos, max_len = limits
    reason = None
    for count, new in enumerate(emitted, 1):
        request.all_token_ids.append(new)
        reason = request.stop_reason(new, eos, max_len)
        if reason is not None:
            emitted = emitted[:count]
            break
    # The step computed the proposals kept before the last emitted token.
    num_kept = len(emitted) - 1 if reason is None else min(len(emitted), num_accepted)
    return Verified(
        tokens=tuple(emitted),
        reason=reason,
        num_kept=num_kept,
        num_accepted=num_accepted,
        logprobs=None if logprobs is None else logprobs[: len(emitted)],
    )


__all__ = ["Verified", "take_verified"]
