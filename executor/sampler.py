"""Pick the next token of each request from its logits.

Per row, in vLLM's order::

    structured output   tokens the request's grammar forbids -> -inf   (executor/structured.py)
    min_tokens, logit_bias, repetition/frequency/presence penalties     (executor/penalties.py)
    greedy              argmax
    otherwise           / temperature, min_p, top_k, top_p, then one draw shared by
                        all sampled rows, each with its own uniform number   (executor/draw.py)

A request with a seed takes its uniform number from a generator seeded by
``(seed, output_index)``: the token at each output position depends only on the seed and
the logits, so the same seed gives the same tokens whatever else runs in the batch, and a
request recomputed after preemption draws them again. Requests without a seed share the
sampler's own generator.

Rows that ask for none of the per-request processing (``params.needs_processing``
false, no min_tokens ban due) cost what they did before it existed: greedy ones share one
argmax over the batch.

Everything runs on the logits' device (the uniform numbers come from CPU generators and
go there), and :meth:`Sampler.sample` reads back one thing: every row's token, in one
copy (``executor/host_copy.py``); the logits stay on the device.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from tokenizers import Tokenizer

from hybridkv.errors import HybridKVError
from hybridkv.executor.draw import draw_rows, filter_logits, settle
from hybridkv.executor.host_copy import to_host_list
from hybridkv.executor.penalties import process_logits
from hybridkv.executor.structured import GrammarMasks
from hybridkv.scheduler.batch import StepRequest
from hybridkv.scheduler.params import StructuredOutput

__all__ = ["Sampler", "StructuredOutputUnavailableError", "filter_logits", "position_seed"]

_MASK64 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # spreads consecutive output indices over the seed space


class StructuredOutputUnavailableError(HybridKVError):
    """A request asks for structured output from a sampler that has no tokenizer."""


def position_seed(seed: int, output_index: int) -> int:
    """A generator seed for one output position of a seeded request."""
    return (seed * 1_000_003 + (output_index + 1) * _GOLDEN) & _MASK64


class Sampler:
    """Samples one token per row of logits, per the row's request.

    Args:
        eos_token_ids: Tokens withheld while a request is under ``min_tokens``, and the
            ones a finished grammar allows.
        seed: Seed of the generator shared by unseeded requests (random if None).
    """

    def __init__(self, *, eos_token_ids: Sequence[int] = (), seed: int | None = None) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self._shared = torch.Generator(device="cpu")
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed)
        self.grammars: GrammarMasks | None = None
        self._grammars_lock = threading.Lock()  # a server reads the vocabulary off the step

    def enable_structured_output(self, tokenizer: Tokenizer, vocab_size: int) -> GrammarMasks:
        """Read the vocabulary for grammar masks now (seconds for a large one) rather
        than in the first step that needs them; the masks. Thread-safe."""
        with self._grammars_lock:
            if self.grammars is None or self.grammars.vocab_size != vocab_size:
                self.grammars = GrammarMasks(tokenizer, vocab_size, self.eos_token_ids)
            return self.grammars

    def compile_grammar(
        self, spec: StructuredOutput, tokenizer: Tokenizer, vocab_size: int
    ) -> None:
        """Read the vocabulary (once) and compile ``spec`` for the steps to come, on the
        caller's thread, so that no step compiles it. Thread-safe.

        Raises:
            GrammarError: llguidance refuses the grammar.
        """
        self.enable_structured_output(tokenizer, vocab_size).compile(spec)

    def sample(
        self,
        logits: torch.Tensor,
        requests: Sequence[StepRequest],
        *,
        tokenizer: Tokenizer | None = None,
    ) -> list[int]:
        """One token per row.

        Args:
            logits: ``[rows, vocab]``, any device; sampling runs there in float32, and the
                tokens are the one thing read back (``executor/host_copy.py``).
            requests: Per row, the request it samples for (its params, its output index,
                its tokens so far).
            tokenizer: The model's tokenizer, needed once by the first request with
                structured output (unless :meth:`enable_structured_output` ran).

        Raises:
            StructuredOutputUnavailableError: a request asks for structured output and
                no tokenizer was ever given.
        """
        rows = logits.detach().float()
        # Greedy rows with nothing to change share one argmax; the others are processed
        # row by row, and all rows that sample share one draw.
        plain = [
            r.params.is_greedy
            and not r.params.needs_processing
            and r.output_index >= r.params.min_tokens
            for r in requests
        ]
        if all(plain):
            return to_host_list(torch.argmax(rows, dim=-1))
        out = torch.zeros(len(plain), dtype=torch.long, device=rows.device)
        greedy = [i for i, ok in enumerate(plain) if ok]
        if greedy:
            out[greedy] = torch.argmax(rows[greedy], dim=-1)
        argmaxes: dict[int, torch.Tensor] = {}
        sampled: list[int] = []
        processed: dict[int, torch.Tensor] = {}
        for i, ok in enumerate(plain):
            if ok:
                continue
            if requests[i].params.needs_processing or requests[i].output_index < (
                requests[i].params.min_tokens
            ):
                processed[i] = self._process_row(rows[i], requests[i], tokenizer)
            if requests[i].params.is_greedy:
                argmaxes[i] = torch.argmax(processed.get(i, rows[i]))
            else:
                sampled.append(i)
        if argmaxes:
            out[list(argmaxes)] = torch.stack(list(argmaxes.values()))
        if not sampled:
            return to_host_list(out)
        chosen = torch.stack([processed.get(i, rows[i]) for i in sampled])
        params = [requests[i].params for i in sampled]
        uniforms = self._uniforms([requests[i] for i in sampled]).to(rows.device)
        drawn, undecided = draw_rows(chosen, params, uniforms)
        out[sampled] = drawn
        # The tokens and the draw's undecided rows come back in one copy.
        both = to_host_list(torch.cat([out, undecided.long()]))
        tokens = both[: len(plain)]
        settled = settle(chosen, params, uniforms, [tokens[i] for i in sampled], both[len(plain) :])
        for i, token in zip(sampled, settled, strict=True):
            tokens[i] = token
        return tokens

    def processed_rows(
        self,
        logits: torch.Tensor,
        requests: Sequence[StepRequest],
        *,
        tokenizer: Tokenizer | None = None,
        masks: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Per row, the float32 logits :meth:`sample` picks from before temperature: the
        request's processing applied (grammar mask, ``min_tokens``, bias, penalties).
        ``masks``: per row, the grammar mask to use instead of the request's matcher's
        (speculative decoding: ``GrammarMasks.logit_masks_ahead``). On the logits' device."""
        rows = logits.detach().float()
        out = []
        for i, (row, request) in enumerate(zip(rows, requests, strict=True)):
            params = request.params
            if params.needs_processing or request.output_index < params.min_tokens:
                mask = None if masks is None else masks[i]
                row = self._process_row(row, request, tokenizer, mask)
            out.append(row)
        return torch.stack(out)

    def grammar_masks(
        self, request: StepRequest, tokenizer: Tokenizer | None, vocab_size: int
    ) -> list[torch.Tensor]:
        """A structured request's grammar mask at each row of its verification step."""
        return self._grammar_masks(vocab_size, tokenizer).logit_masks_ahead(request)

    @property
    def shared_generator(self) -> torch.Generator:
        """The generator unseeded requests draw from."""
        return self._shared

    def _uniforms(self, requests: Sequence[StepRequest]) -> torch.Tensor:
        """One number in [0, 1) per sampled row: from the request's seed and output index
        where it has a seed, else from the shared generator (in row order)."""
        uniforms = torch.empty(len(requests), dtype=torch.float64)
        unseeded = [i for i, r in enumerate(requests) if r.params.seed is None]
        if unseeded:
            uniforms[unseeded] = torch.rand(
                len(unseeded), generator=self._shared, dtype=torch.float64
            )
        for i, request in enumerate(requests):
            seed = request.params.seed
            if seed is not None:
                generator = torch.Generator(device="cpu")
                generator.manual_seed(position_seed(seed, request.output_index))
                uniforms[i] = float(torch.rand(1, generator=generator, dtype=torch.float64))
        return uniforms

    def _process_row(
        self,
        row: torch.Tensor,
        request: StepRequest,
        tokenizer: Tokenizer | None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        params = request.params
        raw = row
        row = process_logits(row, request, self.eos_token_ids)
        if params.structured_output is not None:
            if mask is None:
                mask = self._grammar_masks(row.shape[0], tokenizer).logit_mask(request)
            mask = mask.to(row.device)
            row = row + mask
            if request.output_index < params.min_tokens:
                # min_tokens banned all the grammar allows (EOS at its end): it wins.
                row = torch.where(torch.isfinite(row.max()), row, raw + mask)
        return row

    def _grammar_masks(self, vocab_size: int, tokenizer: Tokenizer | None) -> GrammarMasks:
        if self.grammars is None or self.grammars.vocab_size != vocab_size:
            if tokenizer is None:
                raise StructuredOutputUnavailableError(
                    "a request asks for structured output, and this sampler has no tokenizer "
                    "to build grammar masks from"
                )
            self.enable_structured_output(tokenizer, vocab_size)
        assert self.grammars is not None
        return self.grammars
