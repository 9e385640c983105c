"""The fields of a body that become :class:`~hybridkv.scheduler.params.SamplingParams`.

OpenAI's (``temperature``, ``top_p``, ``presence_penalty``, ``frequency_penalty``,
``logit_bias``, ``seed``) and vLLM's (``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``), each checked and named in its 400; the prompt-length
dependent ones (``max_tokens``, ``min_tokens``) are set later by
:meth:`~hybridkv.serving.openai.protocol.GenerationRequest.sampling_params`.
"""

from __future__ import annotations

from hybridkv.scheduler.params import InvalidRequestError, SamplingParams, StructuredOutput
from hybridkv.serving.openai.errors import APIError
from hybridkv.serving.openai.fields import Fields
from hybridkv.serving.openai.json_text import MAX_INT_DIGITS


def parse_sampling(fields: Fields, structured: StructuredOutput | None) -> SamplingParams:
    """What the engine's sampler does with each token."""
    try:
        return SamplingParams(
            temperature=fields.number("temperature", 1.0, low=0.0, high=2.0),
            top_p=fields.number("top_p", 1.0, low=0.0, high=1.0, open_low=True),
            top_k=_top_k(fields),
            min_p=fields.number("min_p", 0.0, low=0.0, high=1.0),
            seed=fields.optional_integer("seed", low=-(2**63), high=2**63 - 1),
            presence_penalty=fields.number("presence_penalty", 0.0, low=-2.0, high=2.0),
            frequency_penalty=fields.number("frequency_penalty", 0.0, low=-2.0, high=2.0),
            repetition_penalty=fields.number(
                "repetition_penalty", 1.0, low=0.0, high=float("inf"), open_low=True
            ),
            logit_bias=_logit_bias(fields),
            stop_token_ids=fields.token_ids("stop_token_ids"),
            ignore_eos=fields.boolean("ignore_eos", False),
            structured_output=structured,
        )
    except InvalidRequestError as exc:  # a combination the checks above let through
        raise APIError(str(exc)) from None


def _logit_bias(fields: Fields) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}``; biases clamped to [-100, 100], as vLLM does."""
    value = fields.raw("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise fields.error("logit_bias", "must map token ids to biases")
    out = {}
    for key, bias in value.items():
        # Keys by the body's own rule for integers: ASCII digits (str.isdigit takes "²",
        # which int() refuses), at most MAX_INT_DIGITS of them (int() refuses 5,000).
        is_id = key.isascii() and key.isdigit() and len(key) <= MAX_INT_DIGITS
        if not is_id or type(bias) not in (int, float):
            shown = key if len(key) <= 40 else f"{key[:40]}... ({len(key)} characters)"
            raise fields.error(
                "logit_bias", f"must map token ids to numbers, got {shown!r}: {bias!r}"
            )
        out[int(key)] = min(100.0, max(-100.0, float(bias)))
    return out


def _top_k(fields: Fields) -> int:
    top_k = fields.integer("top_k", 0)
    if top_k < -1:
        raise fields.error("top_k", f"must be >= 0 (0 or -1 keep all), got {top_k}")
    return max(top_k, 0)
