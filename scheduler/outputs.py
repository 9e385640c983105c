"""What the engine reports: per-request outputs as they stream, and engine-wide counts."""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs


class FinishReason(enum.StrEnum):
    """Why a request ended.

    ``STOP``: an end-of-sequence or stop token was sampled (it is part of the output).
    ``LENGTH``: ``max_tokens`` were generated or the sequence reached ``max_model_len``.
    ``ABORT``: :meth:`Engine.abort` was called for it.
    ``SHUTDOWN``: the engine stopped while the request was pending.
    """

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    SHUTDOWN = "shutdown"


@attrs.frozen(kw_only=True)
class TokenLogprobs:
    """Log-probabilities at one position of a sequence, from the model's raw logits.

    They are the log-softmax of the logits the model computed (soft-capped where the
    model does so), before temperature, top-k or top-p: what the model thinks of the
    token, whatever the sampler then did (vLLM's default, ``raw_logprobs``).

    Attributes:
        token_id: The token at this position (sampled, or the prompt's).
        logprob: Its log-probability.
        rank: Its rank among all tokens, 1 for the most likely.
        top: The most likely tokens as ``(token_id, logprob)``, most likely first; as many
            as the request asked for (``logprobs`` or ``prompt_logprobs``), maybe none.
    """

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@attrs.frozen(kw_only=True)
class RequestOutput:
    """One streamed update of a request: the tokens sampled by one step.

    Attributes:
        request_id: The request's id.
        new_token_ids: Tokens sampled since the previous output (empty only in the final
            output of an aborted or shut-down request).
        finish_reason: None while the request runs; set in its last output.
        num_prompt_tokens: Tokens of the prompt.
        num_output_tokens: Tokens generated so far, ``new_token_ids`` included.
        num_cached_tokens: Prompt tokens served from the prefix cache at first admission.
        num_preemptions: Times the request was preempted and recomputed.
        logprobs: With ``SamplingParams.logprobs``, one entry per token of
            ``new_token_ids``; else None.
        prompt_logprobs: With ``SamplingParams.prompt_logprobs``, in the request's first
            output only: one entry per prompt token, None for the first (nothing predicts
            it); else None.
        queue_time_s: Seconds from the request's arrival to its first admission (None if
            it was never admitted).
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    queue_time_s: float | None = None
    # The engine's append-only prompt + outputs of the request (private: never mutate
    # it); ``token_ids`` slices it when read, so streaming does not copy it per token.
    _sequence: Sequence[int] = attrs.field(eq=False, repr=False, alias="sequence")

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every token generated so far (cumulative), ``new_token_ids`` last."""
        start = self.num_prompt_tokens
        return tuple(self._sequence[start : start + self.num_output_tokens])

    @property
    def is_finished(self) -> bool:
        """Whether this is the request's last output."""
        return self.finish_reason is not None


@attrs.frozen(kw_only=True)
class SpecDecodeStats:
    """Counts since the engine started (vLLM's ``spec_decode_*`` counters).

    Attributes:
        num_drafts: Proposals verified.
        num_draft_tokens: Tokens proposed, over all of them.
        num_accepted_tokens: Proposed tokens accepted.
        accepted_per_position: Per position of a proposal (0 first), tokens accepted there.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed tokens (0 before any proposal)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@attrs.frozen(kw_only=True)
class EngineStats:
    """A snapshot of the engine's queues, pool and recent throughput.

    Attributes:
        num_waiting: Requests accepted but not running (preempted ones included).
        num_running: Requests holding pages.
        num_preempted: Waiting requests that were preempted and will be recomputed.
        num_preemptions: Preemptions since the engine started.
        num_finished: Requests ended since the engine started (any reason, errors included).
        num_steps: Steps run since the engine started.
        blocks_used_per_group: Pages held per KV group.
        num_free_blocks: Pages an allocation may take (cached free pages included).
        num_blocks: Pages of the pool, the null page included.
        prefix_hit_rate: Prompt tokens served from the prefix cache over those looked up,
            at each request's first admission (recomputation after preemption excluded).
        tokens_per_second: Tokens run through the model per second, from the first step
            of the last 10 seconds until now (so it falls to zero when idle).
        output_tokens_per_second: Tokens generated per second, over the same span.
        num_kv_pages_used: Pages the K/V groups hold.
        num_state_pages_used: Pages the state (mamba-like) groups hold; each takes a span
            of page ids where a state is larger than a K/V page.
        num_free_state_pages: State pages an allocation could take now (spans with no
            page in use; 0 where a state page is one page id).
        spec_decode: Speculative decoding's counts, where the engine speculates.
    """

    num_waiting: int
    num_running: int
    num_preempted: int
    num_preemptions: int
    num_finished: int
    num_steps: int
    blocks_used_per_group: tuple[int, ...]
    num_free_blocks: int
    num_blocks: int
    prefix_hit_rate: float
    tokens_per_second: float
    output_tokens_per_second: float
    num_kv_pages_used: int = 0
    num_state_pages_used: int = 0
    num_free_state_pages: int = 0
    spec_decode: SpecDecodeStats | None = None

    @property
    def kv_usage(self) -> float:
        """The share of the pool's usable pages (the null page left out) that requests
        hold; cached free pages count as free. 1 is full."""
        usable = max(1, self.num_blocks - 1)
        return (usable - self.num_free_blocks) / usable
