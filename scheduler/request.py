"""A request's mutable state, as the engine core tracks it from arrival to finish.

Life of a request::

    generate() --> WAITING --admit--> RUNNING --stop/length--> FINISHED
                      ^                  |
                      +----preempt-------+      (pages freed, tokens kept, recomputed)
    abort, shutdown, a failed step or a refused output end it from any state.

``all_token_ids`` is the prompt followed by every sampled token; it only grows, so a
preempted request is recomputed from it and resumes sampling where it stopped.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Protocol

from hybridkv.errors import HybridKVError
from hybridkv.scheduler.outputs import FinishReason, RequestOutput, TokenLogprobs
from hybridkv.scheduler.params import SamplingParams
from hybridkv.scheduler.speculation import DraftState


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class OutputSink(Protocol):
    """Where a request's outputs go: the send side of a stream (or a list in tests)."""

    def send_nowait(self, item: RequestOutput | HybridKVError) -> None:
        """Deliver one item without waiting."""
        ...

    def close(self) -> None:
        """No further item will come."""
        ...


class Request:
    """One request: its tokens, progress, and bookkeeping. Owned by one event-loop thread.

    Attributes:
        request_id: Unique among live requests.
        params: How to sample and when to stop.
        priority: Lower values are served first; ties go by arrival.
        arrival_seq: Arrival order, unique: with ``priority`` it orders every queue.
        extra_keys: Keys that separate prefix-cache entries (a cache salt).
        all_token_ids: Prompt + sampled tokens (what the KV cache manager hashes).
        num_prompt_tokens: Length of the prompt part of ``all_token_ids``.
        num_computed_tokens: Leading tokens whose K/V a finished step wrote.
        num_cached_tokens: Prompt tokens served from the prefix cache at first admission.
        num_preemptions: Times the request lost its pages to a more urgent one.
        is_preempted: Waiting again after a preemption.
        in_step: Part of a step in flight (planned, not yet applied): its blocks may not be
            freed, and it is in no other step until that one is applied.
        prompt_logprobs: With ``params.prompt_logprobs``, the prompt positions' log-
            probabilities gathered so far (None for position 0); else None.
        sink: Where its outputs go.
        speculative: Whether its decode steps may verify proposed tokens, where the
            engine speculates (``scheduler/speculator.py``).
        draft: Its speculation's state, once it first decodes with speculation on.
        proposed: The tokens the model's MTP layer proposed after its tokens when they
            were this many (speculative method ``mtp``), or None.
        arrival_time, first_scheduled_time, first_token_time: Monotonic clock readings.
    """

    __slots__ = (
        "all_token_ids",
        "arrival_seq",
        "arrival_time",
        "draft",
        "extra_keys",
        "finish_reason",
        "first_scheduled_time",
        "first_token_time",
        "in_step",
        "is_preempted",
        "log",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "params",
        "priority",
        "prompt_logprobs",
        "proposed",
        "request_id",
        "sink",
        "speculative",
        "status",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        arrival_seq: int,
        arrival_time: float,
        sink: OutputSink,
        log: Any,
        priority: int = 0,
        extra_keys: tuple[object, ...] = (),
        speculative: bool = True,
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.priority = priority
        self.arrival_seq = arrival_seq
        self.extra_keys = extra_keys
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.all_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.is_preempted = False
        self.in_step = False
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.sink = sink
        self.log = log
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            None if params.prompt_logprobs is None else [None]
        )
        self.speculative = speculative
        self.draft: DraftState | None = None
        self.proposed: tuple[int, tuple[int, ...]] | None = None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, "
            f"computed={self.num_computed_tokens}/{len(self.all_token_ids)})"
        )

    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled so far."""
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        """Whether the request has ended (its pages may still await the running step)."""
        return self.status is RequestStatus.FINISHED

    # -- events: one line each at info, with the request id bound -------------------------

    def admitted(self, now: float) -> bool:
        """The planner gave it pages: log it; whether it was the first time."""
        is_first = self.first_scheduled_time is None
        if is_first:
            self.first_scheduled_time = now
        self.log_admitted(now, is_first=is_first)
        return is_first

    def log_admitted(self, now: float, *, is_first: bool) -> None:
        """The planner gave it pages (first, or again after a preemption)."""
        self.log.info(
            "request_admitted",
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_computed_tokens,
            num_output_tokens=self.num_output_tokens,
            waited_s=round(now - self.arrival_time, 6) if is_first else None,
            is_resumed=not is_first,
        )

    def log_preempted(self, num_free_blocks: int) -> None:
        """It lost its pages to a more urgent request."""
        self.log.info(
            "request_preempted",
            num_output_tokens=self.num_output_tokens,
            num_preemptions=self.num_preemptions,
            num_free_blocks=num_free_blocks,
        )

    def log_finished(
        self, reason: FinishReason | None, error: HybridKVError | None, now: float
    ) -> None:
        """The one canonical line of a request's end, with its counts and durations."""
        first = self.first_token_time
        self.log.info(
            "request_finished",
            finish_reason=reason.value if reason else None,
            error=repr(error) if error else None,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_preemptions=self.num_preemptions,
            time_to_first_token_s=None if first is None else round(first - self.arrival_time, 6),
            duration_s=round(now - self.arrival_time, 6),
        )

    def stop_reason(
        self, token: int, eos_token_ids: frozenset[int], max_model_len: int
    ) -> FinishReason | None:
        """Why the request ends after sampling ``token`` (already appended), or None."""
        params = self.params
        tokens = self.all_token_ids
        num_output = len(tokens) - self.num_prompt_tokens
        if num_output >= params.min_tokens and (
            token in params.stop_token_ids or (token in eos_token_ids and not params.ignore_eos)
        ):
            return FinishReason.STOP
        if num_output >= params.max_tokens or len(tokens) >= max_model_len:
            return FinishReason.LENGTH
        return None

    def output(
        self,
        new_token_ids: tuple[int, ...],
        finish_reason: FinishReason | None,
        logprobs: tuple[TokenLogprobs, ...] | None = None,
    ) -> RequestOutput:
        """The output to stream after the request's latest tokens.

        The prompt's log-probabilities, if asked for, go with the first output only.
        """
        prompt_logprobs = None
        if self.prompt_logprobs is not None and len(self.all_token_ids) - 1 == (
            self.num_prompt_tokens
        ):
            prompt_logprobs = tuple(self.prompt_logprobs)
        first = self.first_scheduled_time
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=new_token_ids,
            finish_reason=finish_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=len(self.all_token_ids) - self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_preemptions=self.num_preemptions,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            queue_time_s=None if first is None else first - self.arrival_time,
            sequence=self.all_token_ids,
        )
