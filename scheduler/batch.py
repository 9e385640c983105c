"""What one engine step hands to the executor, what it hands back, and the protocol."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Protocol

import attrs

from hybridkv.errors import HybridKVError
from hybridkv.memory.layout import PoolSpec
from hybridkv.memory.offload.transfers import KVTransfers, LoadReport
from hybridkv.scheduler.outputs import TokenLogprobs
from hybridkv.scheduler.params import SamplingParams


class ExecutorBrokenError(HybridKVError):
    """Raised by an executor that cannot run any further step; the engine shuts down."""


class ExecutorResultError(HybridKVError):
    """An executor's step result does not fit its batch (a token out of the vocabulary, a
    missing entry): the step's requests fail, the engine goes on."""


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
        prompt_logprob_token_ids: With ``params.prompt_logprobs``, the prompt tokens at
            positions ``start_position + 1 ..`` that this chunk's positions predict (the
            last prompt position predicts an output token, so a prompt's last chunk has
            one fewer); empty otherwise.
        all_token_ids: Where ``params.needs_processing`` (penalties, structured output),
            the request's prompt and output tokens so far, the last ``output_index`` of
            them outputs; empty otherwise. It is the engine's own list, not a copy: read
            it during ``execute``, never keep or change it.
        num_draft_tokens: Speculative decoding: the last this many of ``token_ids`` are
            proposed, not yet part of the request. The executor samples after every one
            of the request's last ``num_draft_tokens + 1`` positions, keeps the longest
            run of proposals its samples agree with (``executor/verification.py``) and
            one token of its own after it, and keeps the state of a state group only up
            to the last token it kept (``memory/state_pages.py``).
        next_token_id: Where the step does not sample (a prompt chunk before the last),
            the prompt token after the chunk's last: a model's MTP layer reads each
            position with the token after it (``executor/mtp_step.py``); else None.
    """

    request_id: str
    token_ids: Sequence[int]
    start_position: int
    block_tables: Sequence[Sequence[int]]
    sample: bool
    params: SamplingParams
    output_index: int
    prompt_logprob_token_ids: Sequence[int] = ()
    all_token_ids: Sequence[int] = ()
    num_draft_tokens: int = 0
    next_token_id: int | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens run for this request in this step."""
        return len(self.token_ids)

    @property
    def draft_token_ids(self) -> Sequence[int]:
        """The proposed tokens the step verifies (empty without speculation)."""
        num = self.num_draft_tokens
        return self.token_ids[len(self.token_ids) - num :] if num else ()


@attrs.frozen
class StepBatch:
    """All requests of one step, prefills and decodes mixed, in scheduling order.

    ``transfers``: with a KV connector, the loads to start and the pages to save before
    the step's layers run (``hybridkv.memory.offload.transfers``); a step may then run
    no request at all, only to collect loads.
    """

    requests: tuple[StepRequest, ...]
    transfers: KVTransfers | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens run in this step, over all requests."""
        return sum(len(r.token_ids) for r in self.requests)


def _token_tuple(token_ids: Iterable[int | None]) -> tuple[int | None, ...]:
    # A typed converter: mypy reads attrs' converter=tuple as taking Iterable[_T_co].
    return tuple(token_ids)


@attrs.frozen(kw_only=True)
class StepResult:
    """What one step produced, by request: entry ``i`` of each column belongs to
    ``batch.requests[i]``.

    Columns rather than one object per request: a decode step of hundreds of requests
    returns one tuple of ints, which the engine checks and applies at C speed.

    Attributes:
        token_ids: The sampled token where the request's ``sample`` was true, else None.
        logprobs: Where ``params.logprobs`` asked, the sampled token's log-probabilities
            (None elsewhere); None as a whole when no request of the step asked.
        prompt_logprobs: Where ``params.prompt_logprobs`` asked, one entry per token of
            the request's ``prompt_logprob_token_ids``, in order; None as a whole when no
            request of the step asked.
        errors: Request id -> the error that failed that request, and only it, in this
            step (its other entries are ignored); the engine fails it and goes on.
        kv_loads: Loads of earlier steps' transfers that finished by this step, each
            with its loaded and failed (group, block) pages.
        num_accepted: Per request, how many of its ``draft_token_ids`` were accepted (0
            without a proposal); None as a whole when no request of the step proposed.
            The request emits those, then its ``token_ids`` entry.
        accepted_logprobs: Where ``params.logprobs`` asked and proposals were accepted,
            the log-probabilities of each accepted token, in order (``logprobs`` holds
            the last token's); None as a whole when no such request.
        proposals: Per request, the tokens the model's own MTP layer proposes after its
            last (speculative method ``mtp``: ``executor/mtp_step.py``), empty where it
            sampled none; None as a whole from an executor that proposes nothing.
    """

    token_ids: tuple[int | None, ...] = attrs.field(converter=_token_tuple)
    logprobs: tuple[TokenLogprobs | None, ...] | None = None
    prompt_logprobs: tuple[tuple[TokenLogprobs, ...], ...] | None = None
    errors: Mapping[str, HybridKVError] = attrs.field(factory=dict)
    kv_loads: tuple[LoadReport, ...] = ()
    num_accepted: tuple[int, ...] | None = None
    accepted_logprobs: tuple[tuple[TokenLogprobs, ...], ...] | None = None
    proposals: tuple[tuple[int, ...], ...] | None = None


class Executor(Protocol):
    """Runs steps over the pool it reports. The engine calls it from a worker thread.

    Contract: for every request of the batch, write the K/V of its ``token_ids`` into the
    blocks of its block tables, then compute attention (all writes of a layer happen
    before any attention of that layer, so a request may read a block another request of
    the same step fills). Return a :class:`StepResult` with one entry per request. Raise
    any exception to fail the step's requests (the engine goes on), or
    :class:`ExecutorBrokenError` when no later step can succeed.

    ``pool`` is the block pool the executor's caches are laid out for; the engine refuses
    a config that describes another.
    """

    @property
    def pool(self) -> PoolSpec:
        """The block pool the executor's caches hold."""
        ...

    def execute(self, batch: StepBatch) -> StepResult:
        """Run the batch and return what it produced."""
        ...


class PipelinedExecutor(Executor, Protocol):
    """An executor that takes several steps at once (pipeline stages), in order.

    The engine calls :meth:`submit` from its event-loop thread, in step order, with up to
    ``max_steps_in_flight`` steps unfinished, and waits for the futures in the same order.
    Steps must reach every layer in submission order: step k's writes to a layer happen
    before step k+1 reads it (a step may read a block that an earlier step in flight
    fills, through a prefix hit). A request is in at most one step in flight, and the
    blocks of a step in flight are never freed.
    """

    @property
    def max_steps_in_flight(self) -> int:
        """How many submitted steps may be unfinished at once (>= 1)."""
        ...

    def submit(self, batch: StepBatch) -> Future[StepResult]:
        """Start the batch without blocking; the future holds its result or error."""
        ...
