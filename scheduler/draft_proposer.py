"""A draft model as a proposer: a smaller checkpoint, with the target's tokenizer, proposes.

vLLM's ``draft_model`` method. The draft runs on an executor of its own over a pool of its
own (``ModelExecutor.from_pretrained`` of the draft checkpoint, or any executor), greedily,
``k`` tokens per proposal. It keeps no per-request state: each proposal is one draft
request that resumes from the draft's prefix cache, runs the tokens its cache lacks, then
``k - 1`` decode steps, and ends, leaving its blocks cached for the next proposal::

    target tokens   p p p p | p p o o | o o a a | b          a: accepted, b: the bonus
    draft cache     [ hit ] | [ hit ] | [ run ] | run, then k - 1 decodes -> proposal

The cache is exact (blocks are found by the hash of their tokens), so blocks the draft
filled with its own rejected proposals are never found again, and a draft preempted by
its own pool simply recomputes. A proposal is deterministic (the draft's argmax), which
verification treats as a draft putting all its mass on it: sampled requests keep the
target's distribution.

It runs where the engine plans, on the engine's loop thread: a step waits for the draft's
``k`` passes before the target's. Give the draft executor the target's torch thread
(``torch_thread=``) so that both run on one OpenMP team.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import attrs

from hybridkv.errors import HybridKVError
from hybridkv.errors.events import get_logger
from hybridkv.memory.manager import KVCacheManager
from hybridkv.scheduler.batch import Executor, StepBatch, StepRequest
from hybridkv.scheduler.params import SamplingParams

log = get_logger(__name__)

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)


class DraftModelError(HybridKVError):
    """A draft model that cannot serve its target (another vocabulary)."""


@attrs.define
class _DraftRequest:
    request_id: str
    all_token_ids: list[int]
    extra_keys: tuple[object, ...] = ()


class DraftModelProposer:
    """Proposes the draft model's greedy continuation (a ``Proposer``).

    Args:
        executor: Runs the draft model over its own pool.
        vocab_size: The target's vocabulary: the draft's must be the same.
        max_model_len: The draft's longest sequence; longer contexts propose nothing.

    Raises:
        DraftModelError: the draft's vocabulary is not the target's.
    """

    def __init__(self, executor: Executor, *, vocab_size: int, max_model_len: int) -> None:
        draft_vocab = getattr(executor, "vocab_size", vocab_size)
        if draft_vocab != vocab_size:
            raise DraftModelError(
                f"the draft model's vocabulary has {draft_vocab} tokens, the target's "
                f"{vocab_size}: a draft must share the target's tokenizer"
            )
        self.executor = executor
        self.max_model_len = max_model_len
        self.kv = KVCacheManager.for_pool(executor.pool)
        self._ids = itertools.count()

    def propose(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        """The draft's next ``k`` greedy tokens after ``tokens`` (fewer where its context
        or its pool runs out)."""
        k = min(k, self.max_model_len - len(tokens))
        if k < 1:
            return ()
        request = _DraftRequest(f"draft-{next(self._ids)}", list(tokens))
        kv, rid = self.kv, request.request_id
        hit = kv.lookup(request)
        start = hit.num_tokens
        if kv.allocate(request, len(tokens) - start, hit) is None:
            return ()
        out: list[int] = []
        try:
            self._run(request, start, k, out)
        except Exception as exc:  # a failed draft step costs the proposal, not the engine
            kv.free(rid, computed=False)
            log.warning("draft_model_failed", error=repr(exc))
            return ()
        kv.free(rid)
        return tuple(out)

    def _run(self, request: _DraftRequest, start: int, k: int, out: list[int]) -> None:
        """The draft's steps: the tokens its cache lacks, then decodes, into ``out``."""
        kv, rid = self.kv, request.request_id
        while True:
            seq = request.all_token_ids
            item = StepRequest(
                request_id=rid,
                token_ids=seq[start:],
                start_position=start,
                block_tables=kv.block_tables(rid),
                sample=True,
                params=_GREEDY,
                output_index=len(out),
            )
            token = self.executor.execute(StepBatch((item,))).token_ids[0]
            if token is None:
                return
            out.append(token)
            if len(out) == k:
                return
            start = len(seq)
            seq.append(token)
            if kv.allocate(request, 1) is None:
                return

    def close(self) -> None:
        """Close the draft's executor, where it can be closed."""
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()


__all__ = ["DraftModelError", "DraftModelProposer"]
