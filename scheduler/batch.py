"""What one engine step hands to the executor, and the executor protocol itself."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs

from hybridkv.errors import HybridKVError
from hybridkv.scheduler.params import SamplingParams


class ExecutorBrokenError(HybridKVError):
    """Raised by an executor that cannot run any further step; the engine shuts down."""


@attrs.frozen(kw_only=True)
class StepRequest:
    """One request's share of a step.

    Attributes:
        request_id: The request's id.
        token_ids: The tokens to run now, at positions
            ``start_position .. start_position + len(token_ids) - 1``.
        start_position: Tokens of this request already computed (cached or earlier steps).
        block_tables: Per KV group, the request's page ids, one per block of
            ``block_size`` tokens, covering every position up to the last one run now.
            Page 0 is the null block: a block released by the group's policy (or never
            needed), whose contents must not be read. The lists belong to the KV cache
            manager: read them during ``execute``, never keep or change them.
        sample: Whether to sample a token after the last input token (False for a prefill
            chunk that is not the prompt's last).
        params: The request's sampling parameters.
        output_index: How many tokens the request has generated before this step; with
            ``params.seed`` it seeds the sampler, so recomputation samples the same tokens.
    """

    request_id: str
    token_ids: Sequence[int]
    start_position: int
    block_tables: Sequence[Sequence[int]]
    sample: bool
    params: SamplingParams
    output_index: int

    @property
    def num_tokens(self) -> int:
        """Tokens run for this request in this step."""
        return len(self.token_ids)


@attrs.frozen
class StepBatch:
    """All requests of one step, prefills and decodes mixed, in scheduling order."""

    requests: tuple[StepRequest, ...]

    @property
    def num_tokens(self) -> int:
        """Tokens run in this step, over all requests."""
        return sum(len(r.token_ids) for r in self.requests)


class Executor(Protocol):
    """Runs one step. The engine calls it from a worker thread, one step at a time.

    Contract: for every request of the batch, write the K/V of its ``token_ids`` into the
    pages of its block tables, then compute attention (all writes of a layer happen before
    any attention of that layer, so a request may read a page another request of the same
    step fills). Return one entry per request: the sampled token id where ``sample`` is
    true, else ``None``. Raise any exception to fail the step's requests (the engine goes
    on), or :class:`ExecutorBrokenError` when no later step can succeed.
    """

    def execute(self, batch: StepBatch) -> Sequence[int | None]:
        """Run the batch and return the sampled tokens."""
        ...
