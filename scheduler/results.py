"""Checking an executor's step result before the core applies it.

Two levels. The result as a whole (its type, the length of every column, every token id
in range) is checked before anything is applied: a malformed result fails the whole step
(:class:`ExecutorResultError`), since nothing in it can be trusted. Then, request by
request, what concerns one request alone (its own error, a token missing where one was
due, an earlier failed step it resumed from) fails that request only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from hybridkv.errors import HybridKVError
from hybridkv.scheduler.batch import ExecutorResultError, StepRequest, StepResult
from hybridkv.scheduler.outputs import TokenLogprobs
from hybridkv.scheduler.request import Request
from hybridkv.scheduler.step_planner import StepPlan


def check_result(plan: StepPlan, result: object, vocab_size: int) -> str | None:
    """Why an executor's result cannot be applied to ``plan``, or None if it can.

    Checks the columns as wholes (their types and lengths, every token id in range): on
    the hot path of every step, so the common decode step costs C-speed passes only.
    A request whose own entry is missing fails alone, when it is applied.
    """
    if type(result) is not StepResult:
        return f"executor returned {type(result).__name__}, not a StepResult"
    num = len(plan.batch.requests)
    tokens = result.token_ids
    if len(tokens) != num:
        return f"executor returned {len(tokens)} token ids for {num} requests"
    kinds = set(map(type, tokens))
    # type() is int: neither a bool nor a numpy or torch scalar slips through.
    if not kinds <= _TOKEN_TYPES:
        bad = next(t for t in tokens if type(t) not in _TOKEN_TYPES)
        return f"executor sampled {bad!r}, not a token id"
    ints: Sequence[int]
    if type(None) in kinds:
        ints = [t for t in tokens if t is not None]
    else:
        ints = cast("tuple[int, ...]", tokens)  # no None among them (kinds)
    if ints and not (min(ints) >= 0 and max(ints) < vocab_size):
        bad = next(t for t in ints if not 0 <= t < vocab_size)
        return f"executor sampled {bad!r}, not a token id in [0, {vocab_size})"
    for name in ("logprobs", "prompt_logprobs", "num_accepted", "accepted_logprobs", "proposals"):
        column = getattr(result, name)
        if column is not None and len(column) != num:
            return f"executor returned {len(column)} {name} entries for {num} requests"
    proposed = [t for p in result.proposals or () for t in p]
    if proposed and not (min(proposed) >= 0 and max(proposed) < vocab_size):
        return f"executor proposed a token id outside [0, {vocab_size})"
    return None


_TOKEN_TYPES = frozenset({int, type(None)})


def request_failure(
    item: StepRequest, result: StepResult, token: int | None, is_stale: bool
) -> HybridKVError | None:
    """Why this one request of an applicable result fails, or None."""
    error = result.errors.get(item.request_id)
    if error is not None:
        return error
    if item.sample and token is None:
        return ExecutorResultError("the executor sampled no token where one was due")
    if is_stale:
        return ExecutorResultError(
            "an earlier step in flight, which filled its cached prefix, failed"
        )
    return None


def gather_prompt_logprobs(
    request: Request, item: StepRequest, found: tuple[TokenLogprobs, ...]
) -> None:
    """Append the chunk's prompt logprobs not gathered yet (a recomputation repeats some)."""
    gathered = request.prompt_logprobs
    if gathered is None:
        return
    for offset, logprobs in enumerate(found):
        if item.start_position + 1 + offset == len(gathered):
            gathered.append(logprobs)
