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
- **When, and how many.** Where it pays. Verifying tokens costs little more than a decode
  where a step is bound by reading the weights (a small batch), and more than they save
  where it is bound by compute (a large batch on a CPU), in steps rather than smoothly
  (``step_costs.py``). With ``adaptive`` (the default), every decoding request proposes
  and the speculator verifies the ``m`` proposed tokens worth most: token ``i`` of a
  request is kept with chance ``a ** i`` (``a``, the request's own acceptance,
  ``DraftState.acceptance``), and ``m`` maximises the sum, over the step's requests, of
  the log of each one's expected tokens per second, the step taking
  ``StepCosts.estimate(rows + m)`` seconds. A request's gain must so outweigh what the
  longer step costs every other request in it: a higher total alone would let one
  repetitive request slow seven others down. Now and then (after 16 such steps, 32
  more, ... every 256) a step verifies another ``m`` (none, or 1, 2 or 4 more than the
  best) so that the costs follow the load. ``disable_by_batch_size`` (vLLM's key) turns
  proposals off above a batch size outright.
- **Who.** Every decoding request, unless it opted out at submission
  (``speculative=False``); structured output included (each row is masked by the
  grammar after the proposals before it: ``executor/speculative.py``).

The counts are vLLM's ``spec_decode_*``: drafts (proposals verified), draft tokens,
accepted tokens, and accepted tokens per position of the proposal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hybridkv.memory.manager import KVCacheManager
from hybridkv.scheduler.batch import ExecutorResultError, StepRequest, StepResult
from hybridkv.scheduler.config import EngineConfig
from hybridkv.scheduler.outputs import SpecDecodeStats
from hybridkv.scheduler.request import Request
from hybridkv.scheduler.speculation import DraftState, NgramProposer, Proposer, SpeculativeConfig
from hybridkv.scheduler.step_costs import StepCosts
from hybridkv.scheduler.verified import Verified, take_verified

#: Most decode steps a request sits out after proposals that were all rejected.
_MAX_BACKOFF = 64


def _gains(acceptance: float, num_tokens: int) -> list[float]:
    """What verifying each of ``num_tokens`` proposed tokens adds to the log of the
    request's expected tokens this step: token ``i`` is kept with chance
    ``acceptance ** i``, so ``i`` tokens emit ``1 + a + ... + a ** i`` in expectation."""
    gains, expected, chance = [], 1.0, 1.0
    for _ in range(num_tokens):
        chance *= acceptance
        gains.append(math.log1p(chance / expected))
        expected += chance
    return gains


class Speculator:
    """Proposes tokens for decoding requests and keeps the counts. Not thread-safe.

    Args:
        config: The engine's speculative config.
        engine: The engine's config: its ``max_model_len`` (a proposal stops before it)
            and end-of-sequence tokens.
        proposer: What proposes (the config's n-gram lookup when None).
        costs: The executor's step costs (``StepCosts.of``); new ones when None.
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        engine: EngineConfig,
        proposer: Proposer | None = None,
        costs: StepCosts | None = None,
    ) -> None:
        self.config = config
        self.max_model_len = engine.max_model_len
        self._limits = (engine.eos_token_ids, engine.max_model_len)
        # Method mtp: the executor proposes with each step's result (``Request.proposed``).
        self.proposer: Proposer | None = None
        if config.method != "mtp":
            self.proposer = proposer or NgramProposer.for_config(config)
        self._costs = costs or StepCosts()
        self._num_drafts = 0
        self._num_draft_tokens = 0
        self._accepted = [0] * config.num_speculative_tokens

    @classmethod
    def for_engine(
        cls, engine: EngineConfig, proposer: Proposer | None, costs: StepCosts | None = None
    ) -> Speculator | None:
        """The engine's speculator, or None where its config does not speculate."""
        spec = engine.speculative_config
        return None if spec is None else cls(spec, engine, proposer, costs)

    def allows(self, num_running: int) -> bool:
        """Whether a step with ``num_running`` running requests proposes at all
        (``disable_by_batch_size``)."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def proposals(
        self, requests: Sequence[Request], rows: int, num_waiting: int, budget: int
    ) -> list[tuple[int, ...]]:
        """Per decoding request of a step (most urgent first), the tokens to verify after
        its last one, empty where none: at most ``budget`` in all, and with ``adaptive``
        the ones worth the longer step, given it has ``rows`` rows and ``num_waiting``
        requests in all (decodes, prefill chunks) wait for it."""
        drafts = []
        for request in requests:
            draft = self.propose(request, budget) if budget > 0 else ()
            budget -= len(draft)
            drafts.append(draft)
        if not self.config.adaptive or not any(drafts):
            return drafts
        gains = sorted(
            (
                (gain, at)
                for at, (request, draft) in enumerate(zip(requests, drafts, strict=True))
                if (state := request.draft) is not None
                for gain in _gains(state.acceptance, len(draft))
            ),
            key=lambda gain: -gain[0],
        )
        counts = [0] * len(drafts)
        for _, at in gains[: self._choose(rows, num_waiting, [g for g, _ in gains])]:
            counts[at] += 1
        return [draft[:count] for draft, count in zip(drafts, counts, strict=True)]

    def _choose(self, rows: int, num_waiting: int, gains: list[float]) -> int:
        """How many proposed tokens (their gains, best first) to verify in a step of
        ``rows`` rows that ``num_waiting`` requests wait for: the count whose gains
        outweigh most what the longer step costs every one of them, another count now
        and then (after 16 choices, 32 more, 64 more, ... every 256), none where the
        step's own rows were never measured (this step measures them)."""
        plain = self._costs.estimate(rows)
        if plain is None:
            return 0
        best, best_value, total = 0, 0.0, 0.0
        for m, gain in enumerate(gains, 1):
            total += gain
            seconds = self._costs.estimate(rows + m)
            assert seconds is not None, "a count above a measured one has an estimate"
            value = total - num_waiting * math.log(seconds / plain)
            if value > best_value:
                best, best_value = m, value
        more = self._costs.exploration()
        if more is None:
            return best
        return min(len(gains), best + more) if more else 0

    def step_done(self, items: Sequence[StepRequest], seconds: float) -> None:
        """A step ran for ``seconds``: where it ran decodes only (a last token and its
        proposals each), learn what its number of rows costs."""
        if not self.config.adaptive or seconds <= 0.0 or not items:
            return
        for item in items:
            if not item.sample or item.num_tokens - item.num_draft_tokens != 1:
                return  # a prefill chunk: not a measure of decoding
        self._costs.record(sum(item.num_tokens for item in items), seconds)

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
        if self.proposer is None:
            at, proposal = request.proposed or (-1, ())
            return proposal[:k] if at == len(tokens) else ()
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
        state.count(num_proposed, num_accepted)
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
