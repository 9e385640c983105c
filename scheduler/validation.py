"""Checks a request passes before it is queued, so that it can never fail for its shape.

Everything here raises at ``generate`` time, before any page is touched: a malformed
prompt, a sequence longer than the model allows, or one that needs more pages than the
whole pool holds (it could never run, whatever else finishes).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from hybridkv.memory.errors import PromptTooLongError
from hybridkv.memory.hashing import TOKEN_ID_LIMIT
from hybridkv.memory.manager import KVCacheManager
from hybridkv.scheduler.config import EngineConfig
from hybridkv.scheduler.params import InvalidRequestError, SamplingParams


def check_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    config: EngineConfig,
    kv: KVCacheManager,
) -> list[int]:
    """Return the prompt as a list of ints, or raise why it can never be served.

    Raises:
        InvalidRequestError: the prompt is empty or holds ids that are not token ids.
        PromptTooLongError: the prompt leaves no room under ``max_model_len``, or prompt
            and output together need more pages than the pool has.
    """
    try:
        prompt = list(map(operator.index, prompt_token_ids))
    except TypeError as exc:
        raise InvalidRequestError(f"prompt token ids must be integers: {exc}") from None
    if not prompt:
        raise InvalidRequestError("the prompt is empty: at least one token is needed")
    low, high = min(prompt), max(prompt)
    limit = config.vocab_size
    if low < 0 or high >= (TOKEN_ID_LIMIT if limit is None else limit):
        allowed = (
            f"in [0, vocab_size={limit})" if limit is not None else f"in [0, {TOKEN_ID_LIMIT})"
        )
        raise InvalidRequestError(f"prompt token ids must be {allowed}, got {low}..{high}")
    if len(prompt) >= config.max_model_len:
        raise PromptTooLongError(
            f"prompt of {len(prompt)} tokens leaves no room to generate within "
            f"max_model_len={config.max_model_len}"
        )
    # The last sampled token is never computed, so positions up to total - 2 need pages.
    total = min(len(prompt) + params.max_tokens, config.max_model_len)
    needed = kv.num_blocks_needed(total - 1)
    if needed > kv.num_usable_blocks:
        raise PromptTooLongError(
            f"{len(prompt)} prompt + {params.max_tokens} output tokens need {needed} pages, "
            f"more than the pool's {kv.num_usable_blocks}"
        )
    return prompt


def never_fits(request_id: str, num_tokens: int, kv: KVCacheManager) -> PromptTooLongError:
    """The error of a request the planner found needs more pages than an empty pool has
    (a preempted request whose tokens grew past what ``check_request`` admitted)."""
    needed = kv.num_blocks_needed(num_tokens)
    return PromptTooLongError(
        f"request {request_id!r} needs up to {needed} pages, more than an empty pool of "
        f"{kv.num_usable_blocks} can supply"
    )
