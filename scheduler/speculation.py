"""Speculative decoding, the scheduler's side: the configuration and the proposers.

A proposer guesses the next ``k`` tokens of a request; the target model then checks them
all in one step (``hybridkv.executor.verification``), keeping the longest run it agrees
with and one token of its own after it. This module holds what needs no model:

- :class:`SpeculativeConfig`, parsed from vLLM's ``--speculative-config`` JSON
  (``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}``), every
  bad value refused with the key it came from;
- :class:`NgramProposer`, vLLM's ``ngram`` method (prompt lookup): the longest suffix of
  the request's tokens, between ``prompt_lookup_min`` and ``prompt_lookup_max`` tokens
  long, that occurred before; the tokens that followed its latest earlier occurrence are
  the proposal. It costs no model and pays off where outputs copy their input
  (summaries, edits, code).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Literal, Protocol

import attrs

from hybridkv.errors import HybridKVError


class SpeculativeConfigError(HybridKVError, ValueError):
    """A ``--speculative-config`` that names an unknown method or a bad value."""


Method = Literal["ngram", "draft_model", "mtp"]
_METHODS: tuple[Method, ...] = ("ngram", "draft_model", "mtp")
#: vLLM's names of the mtp method for one family's checkpoints: the same method here.
_MTP_ALIASES = frozenset({"qwen3_next_mtp", "deepseek_mtp", "mimo_mtp", "bailing_mtp"})
_KEYS = frozenset(
    {
        "method",
        "num_speculative_tokens",
        "prompt_lookup_min",
        "prompt_lookup_max",
        "model",
        "disable_by_batch_size",
        "adaptive",
    }
)


def _count(value: object, key: str, low: int) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
        raise SpeculativeConfigError(f"speculative config: {key} must be an integer >= {low}")
    return int(value)


@attrs.frozen(kw_only=True)
class SpeculativeConfig:
    """How requests speculate (vLLM's ``--speculative-config``).

    Attributes:
        method: ``ngram`` (prompt lookup), ``draft_model`` (a smaller checkpoint that
            shares the target's tokenizer) or ``mtp`` (the checkpoint's own multi-token
            prediction layer: ``executor/mtp_step.py``; vLLM's ``qwen3_next_mtp``,
            ``deepseek_mtp``, ``mimo_mtp`` and ``bailing_mtp`` name it too).
        num_speculative_tokens: Tokens proposed per step.
        prompt_lookup_min: Shortest suffix the n-gram proposer matches.
        prompt_lookup_max: Longest suffix it tries first.
        model: The draft checkpoint (``draft_model`` only).
        disable_by_batch_size: No proposals in a step while more requests than this run
            (vLLM's key: a large batch is bound by compute, where verifying costs more
            than it saves); None: any batch.
        adaptive: hybridkv's key: measure what a step costs per number of rows and
            verify only the proposed tokens whose requests gain more than the longer step
            costs every request in it (``scheduler/speculator.py``); False: verify every
            proposal.
    """

    method: Method
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None
    disable_by_batch_size: int | None = None
    adaptive: bool = True

    def __attrs_post_init__(self) -> None:
        if self.method not in _METHODS:
            raise SpeculativeConfigError(
                f"speculative config: method {self.method!r} is not one of {list(_METHODS)}"
            )
        _count(self.num_speculative_tokens, "num_speculative_tokens", 1)
        _count(self.prompt_lookup_min, "prompt_lookup_min", 1)
        _count(self.prompt_lookup_max, "prompt_lookup_max", 1)
        if self.disable_by_batch_size is not None:
            _count(self.disable_by_batch_size, "disable_by_batch_size", 1)
        if not isinstance(self.adaptive, bool):
            raise SpeculativeConfigError("speculative config: adaptive must be true or false")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpeculativeConfigError(
                "speculative config: prompt_lookup_min "
                f"({self.prompt_lookup_min}) > prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise SpeculativeConfigError(
                "speculative config: model names the draft checkpoint, for draft_model only"
            )

    @classmethod
    def from_mapping(cls, fields: Mapping[str, object]) -> SpeculativeConfig:
        """Parse vLLM's JSON object; unknown keys are refused by name. vLLM infers
        ``ngram`` where ``method`` is missing and only n-gram keys are given, and so
        does this; one of ``prompt_lookup_min`` / ``_max`` alone sets the other too, and
        neither means 5 and 5, as in vLLM."""
        unknown = sorted(set(fields) - _KEYS)
        if unknown:
            raise SpeculativeConfigError(f"speculative config: unknown keys {unknown}")
        if "num_speculative_tokens" not in fields:
            raise SpeculativeConfigError("speculative config: num_speculative_tokens is required")
        method = fields.get("method", "draft_model" if "model" in fields else "ngram")
        if not isinstance(method, str):
            raise SpeculativeConfigError("speculative config: method must be a string")
        if method in _MTP_ALIASES:
            method = "mtp"
        low = fields.get("prompt_lookup_min", fields.get("prompt_lookup_max", 5))
        high = fields.get("prompt_lookup_max", fields.get("prompt_lookup_min", 5))
        model = fields.get("model")
        if model is not None and not isinstance(model, str):
            raise SpeculativeConfigError("speculative config: model must be a path or name")
        return cls(
            method=method,  # type: ignore[arg-type]  # checked in __attrs_post_init__
            num_speculative_tokens=fields["num_speculative_tokens"],  # type: ignore[arg-type]
            prompt_lookup_min=low,  # type: ignore[arg-type]
            prompt_lookup_max=high,  # type: ignore[arg-type]
            model=model,
            disable_by_batch_size=fields.get("disable_by_batch_size"),  # type: ignore[arg-type]
            adaptive=fields.get("adaptive", True),  # type: ignore[arg-type]
        )


class Proposer(Protocol):
    """Guesses how a request goes on; the target model verifies the guess."""

    def propose(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        """At most ``k`` tokens to follow ``tokens`` (the prompt and the output so far);
        none where it has no guess."""
        ...


@attrs.frozen
class NgramProposer:
    """Prompt lookup: propose what followed the last time the context's tail occurred.

    Tries suffix lengths from ``max_n`` down to ``min_n``; for the first that occurred
    earlier, the latest earlier occurrence wins (the nearest text is likeliest to be
    the one being copied). Proposes at most ``k`` tokens, fewer where the context ends
    first, none where no suffix matched::

        tokens   5 6 7 8 5 6 9 1 5 6        tail (5, 6), k=3
        earlier          ^^^ -> 9 1 5       its latest earlier occurrence, then 3 tokens

    Only the last ``window`` tokens are searched, so a step costs the same at any length.
    """

    min_n: int = 1
    max_n: int = 3
    window: int = 4096

    @classmethod
    def for_config(cls, config: SpeculativeConfig) -> NgramProposer:
        return cls(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, tokens: Sequence[int], k: int) -> tuple[int, ...]:
        """The proposal after ``tokens`` (the prompt and the output so far)."""
        length = len(tokens)
        if length < 2 or k < 1:
            return ()
        first = max(0, length - self.window)
        context = list(tokens[first:])
        last = context[-1]
        size = len(context)
        # Every earlier position holding the last token, latest first: the candidates.
        ends = [e + 1 for e in range(size - 2, -1, -1) if context[e] == last]
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            tail = context[size - n :]
            for end in ends:
                if end >= n and context[end - n : end] == tail:
                    return tuple(context[end : min(end + k, size)])
        return ()


#: Weight kept by a request's earlier verifications when a new one is counted.
_MEMORY = 0.9


@attrs.define(slots=True)
class DraftState:
    """One request's speculation: its current ``k``, its back-off, and how often its
    proposed tokens are kept."""

    k: int
    skip: int = 0  # decode steps left without a proposal
    misses: int = 0  # proposals in a row with nothing accepted
    kept: float = 0.0  # proposed tokens kept (decayed counts)
    rejected: float = 0.0  # verifications that rejected a token (decayed counts)

    @property
    def acceptance(self) -> float:
        """The chance that a proposed token is kept given the one before it was: kept
        tokens over kept tokens and rejections, from a prior of 2 in 3, so a request's
        first proposals are tried; always in (0, 1)."""
        return (self.kept + 2.0) / (self.kept + self.rejected + 3.0)

    def count(self, num_proposed: int, num_accepted: int) -> None:
        """A verification kept ``num_accepted`` of ``num_proposed`` tokens; earlier ones
        weigh ``_MEMORY`` less each time, so the rate follows the text."""
        self.kept = _MEMORY * self.kept + num_accepted
        self.rejected = _MEMORY * self.rejected + (num_accepted < num_proposed)


__all__ = [
    "DraftState",
    "NgramProposer",
    "Proposer",
    "SpeculativeConfig",
    "SpeculativeConfigError",
]
