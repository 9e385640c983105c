"""Speculative decoding, the engine's side: what each decode step proposes, and the counts.

A decoding request whose speculation is on runs its last token and up to ``k`` proposed
tokens in one step; the executor verifies them and emits the accepted ones and one of its
own (``hybridkv.executor.verification``). The :class:`Speculator` decides the proposal
and learns from the outcome:

- **How many.** ``k`` starts at ``num_speculative_tokens``; a verification that stops
  early sets it to one more than it accepted, one that accepts all doubles it (up to
  the configured ``k``). A proposal never runs past ``max_tokens`` or ``max_model_len``.
- **Backing off.** A proposal with nothing accepted costs a step its extra rows and gains
  nothing: after ``m`` such proposals in a row, the request proposes nothing for the next
  ``2 ** m`` decode steps (at most 64), so on text that does not copy its context the
  steps are plain decodes again.
- **When.** Every step, unless more requests run than ``disable_by_batch_size``
  (vLLM's key): a large batch is bound by compute, not by reading the weights, and
  verifying costs it more than it saves.
- **Who.** Every decoding request, unless it opted out at submission
  (``speculative=False``); structured output included (each row is masked by the
  grammar after the proposals before it: ``executor/speculative.py``).

The counts are vLLM's ``spec_decode_*``: drafts (proposals verified), draft tokens,
accepted tokens, and accepted tokens per position of the proposal.
"""

from __future__ import annotations

from hybridkv.memory.manager import KVCacheManager
from hybridkv.scheduler.batch import ExecutorResultError, StepRequest, StepResult
from hybridkv.scheduler.config import EngineConfig
from hybridkv.scheduler.outputs import SpecDecodeStats
from hybridkv.scheduler.request import Request
from hybridkv.scheduler.speculation import DraftState, NgramProposer, Proposer, SpeculativeConfig
from hybridkv.scheduler.verified import Verified, take_verified

#: Most decode steps a request sits out after proposals that were all rejected.
_MAX_BACKOFF = 64


class Speculator:
    """Proposes tokens for decoding requests and keeps the counts. Not thread-safe.

    Args:
        config: The engine's speculative config.
        engine: The engine's config: its ``max_model_len`` (a proposal stops before it)
            and end-of-sequence tokens.
        proposer: What proposes (the config's n-gram lookup when None).
    """

    def __init__(
        self, config: SpeculativeConfig, engine: EngineConfig, proposer: Proposer | None = None
    ) -> None:
        self.config = config
        self.max_model_len = engine.max_model_len
        self._limits = (engine.eos_token_ids, engine.max_model_len)
        self.proposer = proposer or NgramProposer.for_config(config)
        self._num_drafts = 0
        self._num_draft_tokens = 0
        self._accepted = [0] * config.num_speculative_tokens

    @classmethod
    def for_engine(cls, engine: EngineConfig, proposer: Proposer | None) -> Speculator | None:
        """The engine's speculator, or None where its config does not speculate."""
        spec = engine.speculative_config
        return None if spec is None else cls(spec, engine, proposer)

    def allows(self, num_running: int) -> bool:
        """Whether a step with ``num_running`` running requests proposes at all
        (``disable_by_batch_size``)."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def propose(self, request: Request, limit: int) -> tuple[int, ...]:
        """The tokens to verify after ``request``'s last one (at most ``limit``); empty
        where it does not speculate this step."""
        if not request.speculative:
            return ()
        state = request.draft
        if state is None:
            state = request.draft = DraftState(self.config.num_speculative_tokens)
        if state.skip:
            state.skip -= 1
            return ()
        tokens = request.all_token_ids
        # The last token runs too, and the bonus token after the proposal must still fit.
        k = min(
            state.k,
            limit,
            request.params.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - len(tokens) - 1,
        )
        if k < 1:
            return ()
        return self.proposer.propose(tokens, k)

    def take(
        self,
        request: Request,
        item: StepRequest,
        entry: tuple[StepResult, int],
        kv: KVCacheManager,
    ) -> Verified | ExecutorResultError:
        """Take a verification step's tokens for ``request`` (entry ``i`` of the result):
        append them (``scheduler/verified.py``), count the kept proposals as computed in the
        request and the KV cache manager, learn from the outcome; an error where the
        executor's answer does not fit."""
        result, index = entry
        verified = take_verified(request, item, result, index, self._limits)
        if isinstance(verified, ExecutorResultError):
            return verified
        self.verified(request, item.num_draft_tokens, verified.num_accepted)
        request.num_computed_tokens += 1 + verified.num_kept
        kv.accept(request, verified.num_kept)
        return verified

    def verified(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """Record a verification of ``num_proposed`` tokens, ``num_accepted`` kept."""
        self._num_drafts += 1
        self._num_draft_tokens += num_proposed
        for position in range(num_accepted):
            self._accepted[position] += 1
        state = request.draft
        assert state is not None, "a request verified a proposal it never made"
        limit = self.config.num_speculative_tokens
        if num_accepted == num_proposed:
            state.k = min(limit, 2 * num_proposed)
        else:
            state.k = min(limit, num_accepted + 1)
        if num_accepted:
            state.misses = 0
        else:
            state.misses += 1
            state.skip = min(_MAX_BACKOFF, 2**state.misses)

    def stats(self) -> SpecDecodeStats:
        """The counts so far."""
        return SpecDecodeStats(
            num_drafts=self._num_drafts,
            num_draft_tokens=self._num_draft_tokens,
            num_accepted_tokens=sum(self._accepted),
            accepted_per_position=tuple(self._accepted),
        )


__all__ = ["Speculator"]
