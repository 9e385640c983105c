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
- **When.** Where it pays. Verifying ``k`` tokens costs little more than a decode where a
  step is bound by reading the weights (a small batch), and more than it saves where it
  is bound by compute (a large batch on a CPU). With ``adaptive`` (the default), the
  speculator keeps, per number of decoding requests in a step, the tokens emitted per
  second by steps with proposals and by steps without (moving averages of steps of
  decodes only), proposes where the first is the higher, and every 16th such step tries
  the other way, so the choice follows the load. ``disable_by_batch_size`` (vLLM's key)
  turns proposals off above a batch size outright.
- **Who.** Every decoding request, unless it opted out at submission
  (``speculative=False``); structured output included (each row is masked by the
  grammar after the proposals before it: ``executor/speculative.py``).

The counts are vLLM's ``spec_decode_*``: drafts (proposals verified), draft tokens,
accepted tokens, and accepted tokens per position of the proposal.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.memory.manager import KVCacheManager
from hybridkv.scheduler.batch import ExecutorResultError, StepRequest, StepResult
from hybridkv.scheduler.config import EngineConfig
from hybridkv.scheduler.outputs import SpecDecodeStats
from hybridkv.scheduler.request import Request
from hybridkv.scheduler.speculation import DraftState, NgramProposer, Proposer, SpeculativeConfig
from hybridkv.scheduler.verified import Verified, take_verified

#: Most decode steps a request sits out after proposals that were all rejected.
_MAX_BACKOFF = 64
#: Every this many steps of a batch size, the kind of step the rates do not favour.
_EXPLORE = 16
#: Weight of a new step's rate in the moving averages.
_SMOOTHING = 0.25


class StepRates:
    """Per number of decodes in a step, tokens emitted per second by steps without and
    with proposals (exponential moving averages), and which kind the next step should be."""

    def __init__(self) -> None:
        self._rates: dict[int, list[float | None]] = {}  # size -> [plain, proposed]
        self._calls: dict[int, int] = {}

    def choose(self, size: int) -> bool:
        """Whether a step of ``size`` decodes should propose: untried first (proposing,
        then not), then the faster, and the slower every ``_EXPLORE``-th time."""
        plain, proposed = self._rates.setdefault(size, [None, None])
        if proposed is None:
            return True
        if plain is None:
            return False
        calls = self._calls[size] = self._calls.get(size, 0) + 1
        better = proposed >= plain
        return not better if calls % _EXPLORE == 0 else better

    def record(self, size: int, proposed: bool, rate: float) -> None:
        """A step of ``size`` decodes, with proposals or not, emitted ``rate`` tokens/s."""
        rates = self._rates.setdefault(size, [None, None])
        old = rates[proposed]
        rates[proposed] = rate if old is None else old + _SMOOTHING * (rate - old)


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
        self._rates = StepRates()
        self._num_drafts = 0
        self._num_draft_tokens = 0
        self._accepted = [0] * config.num_speculative_tokens

    @classmethod
    def for_engine(cls, engine: EngineConfig, proposer: Proposer | None) -> Speculator | None:
        """The engine's speculator, or None where its config does not speculate."""
        spec = engine.speculative_config
        return None if spec is None else cls(spec, engine, proposer)

    def allows(self, num_running: int, num_decodes: int) -> bool:
        """Whether a step with ``num_running`` running requests, ``num_decodes`` of them
        decoding, proposes at all (``disable_by_batch_size``, ``adaptive``)."""
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running > limit:
            return False
        return self._rates.choose(num_decodes) if self.config.adaptive else True

    def step_done(self, items: Sequence[StepRequest], seconds: float, num_emitted: int) -> None:
        """A step ran for ``seconds`` and emitted ``num_emitted`` tokens: where it ran
        decodes only, learn the rate of its kind (with proposals or without)."""
        if not self.config.adaptive or seconds <= 0.0 or not items:
            return
        proposed = False
        for item in items:
            if not item.sample or item.num_tokens - item.num_draft_tokens != 1:
                return  # a prefill chunk: not a measure of decoding
            proposed = proposed or bool(item.num_draft_tokens)
        self._rates.record(len(items), proposed, num_emitted / seconds)

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
