"""Sampling parameters: what a user of an OpenAI-style API sets per request."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Literal, TypeGuard

import attrs

from hybridkv.errors import HybridKVError


class InvalidRequestError(HybridKVError, ValueError):
    """A request was malformed: bad sampling parameters, empty or oversized prompt."""


#: Most top log-probabilities a request may ask for, per position (as vLLM's default).
MAX_LOGPROBS = 20


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)


def _is_int(value: object) -> TypeGuard[numbers.Integral]:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _as_int_tuple(value: object) -> tuple[int, ...]:
    # A bad parameter must fail here, not in the executor, where it fails the whole step.
    items: tuple[object, ...] | None
    try:
        items = tuple(value)  # type: ignore[arg-type]  # not iterable: TypeError, below
    except TypeError:
        items = None
    if items is None or not all(_is_int(v) for v in items):
        raise InvalidRequestError(f"stop_token_ids must be a sequence of ints, got {value!r}")
    return tuple(int(v) for v in items if _is_int(v))  # all are: the filter types v


def _as_bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    # A mapping {token id: bias} or (token id, bias) pairs, kept sorted: equal biases
    # compare equal however they were given.
    pairs = value.items() if isinstance(value, Mapping) else value
    try:
        items = [tuple(p) for p in pairs]  # type: ignore[attr-defined]
    except TypeError:
        items = None
    if items is None or not all(len(p) == 2 and _is_int(p[0]) and _is_real(p[1]) for p in items):
        raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {value!r}")
    return tuple(sorted((int(t), float(b)) for t, b in items))


#: The kinds of :class:`StructuredOutput`.
StructuredKind = Literal["json_schema", "regex", "choice", "grammar"]


@attrs.frozen
class StructuredOutput:
    """A constraint on the generated text, enforced token by token by the sampler.

    Attributes:
        kind: ``json_schema`` (``spec`` is a JSON schema, as JSON text; ``{"type":
            "object"}`` is any object), ``regex``, ``choice`` (``spec`` is a JSON list
            of strings: the text is one of them) or ``grammar`` (a Lark or GBNF grammar).
        spec: The schema, expression, choices or grammar.
        any_whitespace: JSON schemas: any whitespace between tokens (vLLM's
            ``disable_any_whitespace`` false); False: compact JSON. None: the default,
            True, as vLLM's default backend.
        additional_properties: JSON schemas: objects may hold properties their schema
            does not list, where it says nothing (vLLM's ``disable_additional_properties``
            false). None: the default, False, as vLLM's default backend (xgrammar's
            strict mode); a schema's own ``additionalProperties`` always holds.
    """

    kind: StructuredKind
    spec: str
    any_whitespace: bool | None = None
    additional_properties: bool | None = None

    def __attrs_post_init__(self) -> None:
        kinds = ("json_schema", "regex", "choice", "grammar")
        _check(
            self.kind in kinds, f"structured_output.kind must be one of {kinds}, got {self.kind!r}"
        )
        _check(
            isinstance(self.spec, str) and bool(self.spec),
            f"structured_output.spec must be a non-empty string, got {self.spec!r}",
        )


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    Attributes:
        max_tokens: Most tokens to generate (>= 1).
        min_tokens: Fewest tokens to generate before EOS or a stop token may end the request.
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: Nucleus sampling: keep the smallest set of tokens whose mass reaches top_p.
        top_k: Keep the k most likely tokens; 0 keeps all.
        seed: Per-request seed, best effort as OpenAI's: the same seed, prompt and
            parameters give the same tokens when the batches they run in are the same
            (and after a preemption, which draws each position again from the same
            seed). The draw itself depends only on the seed, the output position and the
            row's logits, never on the other rows; but the logits do: the model's matrix
            products round differently with the batch's row count (float32 BLAS differs
            in the last bits between 1 row and 2 or more, the int8 and LM-head kernels
            switch paths at 32 and 64 rows), so other requests in the batch may change a
            logit's last bits and with it a draw near a boundary.
        stop_token_ids: Tokens that end the request (included in the output).
        ignore_eos: Keep generating past the model's end-of-sequence token.
        logprobs: Return each sampled token's log-probability and the ``logprobs`` most
            likely tokens at its position (0: the sampled token's only); None: none.
        prompt_logprobs: Return each prompt token's log-probability and the
            ``prompt_logprobs`` most likely tokens at its position; None: none. Such a
            request computes its whole prompt: it takes no prefix-cache hit.
        presence_penalty: Subtracted from the logit of every token already generated
            (in [-2, 2]; OpenAI's definition).
        frequency_penalty: Subtracted once per earlier occurrence in the output (in
            [-2, 2]).
        repetition_penalty: Divides positive logits and multiplies negative ones of
            every token in the prompt or the output (> 0; 1 leaves them).
        logit_bias: ``(token id, bias)`` pairs added to the logits (bias in [-100, 100]);
            a mapping is accepted too.
        min_p: Drop tokens less likely than ``min_p`` times the most likely one (after
            temperature; 0 disables it).
        structured_output: A constraint the text must follow; None: none.
        parent_id: The request this one is a copy of (the ``n``/``best_of`` choices of
            one API request share it); copies of one parent hold at most
            ``EngineConfig.max_copies_running`` running slots at once. None: a request
            of its own. Not a sampling setting: the engine's scheduler reads it.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_as_int_tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_as_bias_pairs)
    min_p: float = 0.0
    structured_output: StructuredOutput | None = None
    parent_id: str | None = None
    #: Whether sampling does more than temperature, top-k and top-p: penalties, a logit
    #: bias, min-p or structured output (then the sampler reads the request's tokens so
    #: far). Derived; a plain attribute because the planner reads it for every request.
    needs_processing: bool = attrs.field(init=False, default=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        optional = ("seed", "logprobs", "prompt_logprobs")
        for name in ("max_tokens", "min_tokens", "top_k", *optional):
            value = getattr(self, name)
            _check(
                _is_int(value) or (name in optional and value is None),
                f"{name} must be an int, got {value!r}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or 0 <= value <= MAX_LOGPROBS,
                f"{name} must be in [0, {MAX_LOGPROBS}] or None, got {value!r}",
            )
        floats = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
        for name in (*floats, "repetition_penalty", "min_p"):
            value = getattr(self, name)
            _check(
                _is_real(value) and math.isfinite(value),
                f"{name} must be a finite number, got {value!r}",
            )
        _check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(
            0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
        )
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value}")
        _check(
            self.repetition_penalty > 0.0,
            f"repetition_penalty must be > 0, got {self.repetition_penalty}",
        )
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            self.parent_id is None or isinstance(self.parent_id, str),
            f"parent_id must be a string or None, got {self.parent_id!r}",
        )
        _check(
            self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
            f"structured_output must be a StructuredOutput, got {self.structured_output!r}",
        )
        for token_id, bias in self.logit_bias:
            _check(token_id >= 0, f"logit_bias token ids must be >= 0, got {token_id}")
            _check(
                math.isfinite(bias) and -100.0 <= bias <= 100.0,
                f"logit_bias of token {token_id} must be in [-100, 100], got {bias}",
            )
        processing = (
            self.has_penalties
            or bool(self.logit_bias)
            or self.structured_output is not None
            or (self.min_p > 0.0 and not self.is_greedy)
        )
        object.__setattr__(self, "needs_processing", processing)

    @property
    def has_penalties(self) -> bool:
        """Whether a presence, frequency or repetition penalty applies."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def is_greedy(self) -> bool:
        """Whether sampling is the argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1
