"""Structured output: per-request grammar matchers that say which tokens may come next.

A request's :class:`~hybridkv.scheduler.params.StructuredOutput` compiles (llguidance)
into a matcher over the tokenizer's vocabulary. Before each sampled token the matcher
has consumed every output token so far, and its bitmask sets the logits of the tokens
the grammar forbids to ``-inf``::

    output so far   {"name": "Bo          the matcher consumed these tokens
    mask            b  ob  "  ...         tokens that keep the text a valid prefix
    accepting       EOS allowed           (a finished grammar allows only EOS)

The matchers are a cache, never the truth: each is keyed by request id and advanced from
the request's own token list (``StepRequest.all_token_ids``), so a request preempted and
recomputed, or one whose matcher was evicted, gets a matcher rebuilt from its tokens.
Compiled grammars are cached too, so ``n`` copies of a request compile once, and a
server compiles each request's grammar before queueing it (:meth:`GrammarMasks.compile`,
from a worker thread), so that no step compiles one and a grammar llguidance refuses
is a 400 rather than a request that may sample only EOS.

llguidance is imported only when a request asks for structured output; requests
without it cost nothing here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from tokenizers import Tokenizer

from hybridkv.errors.events import get_logger
from hybridkv.executor.grammars import GrammarError, grammar_text
from hybridkv.scheduler.batch import StepRequest
from hybridkv.scheduler.params import StructuredOutput

log = get_logger(__name__)


@attrs.define
class _Entry:
    """One request's matcher and how many of its output tokens it has consumed."""

    tokens: Sequence[int]  # the request's token list (identity tells requests apart)
    spec: StructuredOutput
    matcher: Any
    num_consumed: int = 0


class GrammarMasks:
    """Token masks of requests with structured output, one matcher per request.

    Args:
        tokenizer: The model's tokenizer (its vocabulary is read once: seconds for a
            large one).
        vocab_size: Width of the logits (may exceed the tokenizer's vocabulary).
        eos_token_ids: Tokens that end a request (allowed once the grammar accepts).
        capacity: Matchers kept; the least recently used beyond it are dropped (and
            rebuilt from the request's tokens if it samples again).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        capacity: int = 1024,
    ) -> None:
        from llguidance import LLTokenizer

        self.vocab_size = vocab_size
        eos = list(eos_token_ids) or None
        try:
            self._tokenizer = LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos)
        except ValueError as exc:  # a tokenizer.json llguidance cannot read
            raise GrammarError(
                f"structured output is unavailable: llguidance cannot read this model's "
                f"tokenizer ({exc})"
            ) from None
        self._capacity = capacity
        self._live: OrderedDict[str, _Entry] = OrderedDict()
        self._compiled: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._compile_lock = threading.Lock()  # servers compile from worker threads
        # llguidance writes one bit per token into these words; a byte indexes the
        # additive mask of its 8 tokens (a table lookup, cheaper than a masked_fill
        # with a bool mask over a large vocabulary: benchmarks/decode/structured_output.py).
        self._words = torch.empty(-(-vocab_size // 32), dtype=torch.int32)
        bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
        self._byte_masks = torch.where(bits.bool(), 0.0, float("-inf"))

    def logit_mask(self, request: StepRequest) -> torch.Tensor:
        """``[vocab]`` float32: 0 for the tokens ``request`` may sample next, ``-inf`` for
        the others (add it to the logits)."""
        return self._mask(self._synced(request))

    def logit_masks_ahead(self, request: StepRequest) -> list[torch.Tensor]:
        """The masks of a verification step (speculative decoding): one per row of the
        request, ``k + 1`` for ``k`` proposed tokens, row ``i``'s as if proposals ``0 ..
        i-1`` were output. Past a proposal the grammar forbids, the rows repeat that
        row's mask (verification stops there: the proposal has probability 0). The
        matcher steps back over the proposals afterwards, so it holds only outputs."""
        matcher = self._synced(request)
        masks = [self._mask(matcher)]
        consumed = 0
        for token in request.draft_token_ids:
            if matcher.is_error() or not torch.isfinite(masks[-1][token]):
                break
            matcher.consume_tokens([token])
            consumed += 1
            masks.append(self._mask(matcher))
        if consumed:
            matcher.rollback(consumed)
        masks.extend([masks[-1]] * (request.num_draft_tokens + 1 - len(masks)))
        return masks

    def _synced(self, request: StepRequest) -> Any:
        """The request's matcher, having consumed every output token so far."""
        entry = self._entry(request)
        matcher = entry.matcher
        tokens = request.all_token_ids
        start = len(tokens) - request.output_index
        new = list(tokens[start + entry.num_consumed :])
        if new and not matcher.is_error():
            matcher.consume_tokens(new)
        entry.num_consumed = request.output_index
        if matcher.is_error():
            # The matcher now allows only EOS: the request ends, as vLLM's does.
            error = matcher.get_error()  # it may quote the whole grammar: the start is enough
            log.warning("structured_output_error", request_id=request.request_id, error=error[:300])
        return matcher

    def _mask(self, matcher: Any) -> torch.Tensor:
        words = self._words
        matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        masks = self._byte_masks.index_select(0, words.view(torch.uint8).long())
        return masks.view(-1)[: self.vocab_size]

    def _entry(self, request: StepRequest) -> _Entry:
        spec = request.params.structured_output
        assert spec is not None, "only requests with structured output reach the masks"
        entry = self._live.get(request.request_id)
        if (
            entry is None
            or entry.tokens is not request.all_token_ids
            or entry.spec != spec
            or entry.num_consumed > request.output_index
        ):
            entry = _Entry(request.all_token_ids, spec, self._fresh_matcher(spec))
            self._live[request.request_id] = entry
        self._live.move_to_end(request.request_id)
        while len(self._live) > self._capacity:
            self._live.popitem(last=False)
        return entry

    def compile(self, spec: StructuredOutput) -> None:
        """Compile ``spec`` against the vocabulary into the cache the steps read.
        Thread-safe: a server calls it before queueing the request.

        Raises:
            GrammarError: llguidance refuses the grammar.
        """
        compiled = self._compiled_matcher(spec)
        if compiled.is_error():
            with self._compile_lock:
                self._compiled.pop(spec, None)
            raise GrammarError(f"the {spec.kind} does not compile: {compiled.get_error()}")

    def _fresh_matcher(self, spec: StructuredOutput) -> Any:
        return self._compiled_matcher(spec).deep_copy()

    def _compiled_matcher(self, spec: StructuredOutput) -> Any:
        from llguidance import LLMatcher

        with self._compile_lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled
        # Compiled outside the lock: two threads may compile one spec; either result serves.
        compiled = LLMatcher(self._tokenizer, grammar_text(spec), log_level=0)
        with self._compile_lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > 64:
                self._compiled.popitem(last=False)
        return compiled
