"""Checking a step batch against the layout before any layer runs.

Every check here depends only on the batch and the plan, so a pipeline runs them once,
in the engine's process, before the step reaches any stage: a batch that fails them
fails its own step, and no stage ever has to leave the pipeline half-way through one.
"""

from __future__ import annotations

from hybridkv.executor.errors import BatchError
from hybridkv.memory.layout import LayoutPlan
from hybridkv.policies.base import cdiv
from hybridkv.scheduler.batch import StepBatch, StepRequest


def check_batch(batch: StepBatch, plan: LayoutPlan, max_model_len: int) -> None:
    """Raise :class:`BatchError` naming the first request that does not fit the layout.

    Each request runs at least one token from a position >= 0, stays within
    ``max_model_len``, has one block table per group, each covering its positions, and
    writes its new tokens into real pages, never into the null block 0.
    """
    for request in batch.requests:
        _check_request(request, plan, max_model_len)


def _check_request(request: StepRequest, plan: LayoutPlan, max_model_len: int) -> None:
    start, end = request.start_position, request.start_position + request.num_tokens
    if request.num_tokens < 1 or start < 0:
        raise BatchError(
            f"request {request.request_id!r} runs {request.num_tokens} tokens from "
            f"position {start}; need >= 1 token from position >= 0"
        )
    if end > max_model_len:
        raise BatchError(
            f"request {request.request_id!r} reaches {end} tokens, max_model_len={max_model_len}"
        )
    if len(request.block_tables) != len(plan.groups):
        raise BatchError(
            f"request {request.request_id!r} has {len(request.block_tables)} block "
            f"tables, the layout has {len(plan.groups)} KV groups"
        )
    bs = plan.block_size
    need = cdiv(end, bs)
    for group, table in enumerate(request.block_tables):
        if len(table) < need:
            raise BatchError(
                f"request {request.request_id!r}: block table of group {group} has "
                f"{len(table)} pages, {end} tokens need {need}"
            )
        # A state group's page holds a state, not tokens: a step needs only the page of
        # its last block (hybridkv.memory.state_pages); a K/V group needs every block, or
        # those its policy gives pages (compressed entries spanning blocks).
        policy = plan.groups[group].policy
        blocks = range(need - 1 if policy.keeps_state else start // bs, need)
        named = None if policy.keeps_state else policy.page_blocks(start, end, bs)
        if any(table[i] == 0 for i in (blocks if named is None else named)):
            raise BatchError(
                f"request {request.request_id!r}: block table of group {group} maps a "
                f"position in [{start}, {end}) to the null block"
            )
