"""Sampling parameters: what a user of an OpenAI-style API sets per request."""

from __future__ import annotations

import numbers

import attrs

from hybridkv.errors import HybridKVError


class InvalidRequestError(HybridKVError, ValueError):
    """A request was malformed: bad sampling parameters, empty or oversized prompt."""


#: Most top log-probabilities a request may ask for, per position (as vLLM's default).
MAX_LOGPROBS = 20


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _as_int_tuple(value: object) -> tuple[int, ...]:
    # A bad parameter must fail here, not in the executor, where it fails the whole step.
    try:
        items = tuple(value)  # type: ignore[call-overload]
    except TypeError:
        items = None
    if items is None or not all(_is_int(v) for v in items):
        raise InvalidRequestError(f"stop_token_ids must be a sequence of ints, got {value!r}")
    return tuple(int(v) for v in items)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    Attributes:
        max_tokens: Most tokens to generate (>= 1).
        min_tokens: Fewest tokens to generate before EOS or a stop token may end the request.
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: Nucleus sampling: keep the smallest set of tokens whose mass reaches top_p.
        top_k: Keep the k most likely tokens; 0 keeps all.
        seed: Per-request seed. The same seed gives the same tokens, whatever else runs in
            the batch and whether or not the request was preempted and recomputed.
        stop_token_ids: Tokens that end the request (included in the output).
        ignore_eos: Keep generating past the model's end-of-sequence token.
        logprobs: Return each sampled token's log-probability and the ``logprobs`` most
            likely tokens at its position (0: the sampled token's only); None: none.
        prompt_logprobs: Return each prompt token's log-probability and the
            ``prompt_logprobs`` most likely tokens at its position; None: none. Such a
            request computes its whole prompt: it takes no prefix-cache hit.
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
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            _check(_is_real(value), f"{name} must be a number, got {value!r}")
        _check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(
            0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
        )
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def is_greedy(self) -> bool:
        """Whether sampling is the argmax (temperature 0 or top_k 1)."""
        return self.temperature == 0.0 or self.top_k == 1
