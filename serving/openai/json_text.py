"""A request body's JSON, decoded strictly: every way it can be wrong is a 400 with an
OpenAI error body, never a 500::

    not UTF-8, not JSON, not an object  400
    NaN, Infinity, 1e999                400   (not JSON numbers; NaN used to reach the sampler)
    an integer literal over 100 digits  400   (Python's limit raised a 500)
    nesting deeper than 64              400   (100k brackets raised RecursionError)
    a lone surrogate (\\ud800)           400   (the tokenizer cannot encode it)

The same limits hold for JSON sent inside a string of the body (a schema as a string).
Large bodies are decoded in a worker thread.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import anyio

from hybridkv.serving.openai.errors import APIError

#: Deepest nesting of arrays and objects accepted.
MAX_DEPTH = 64
#: Longest integer literal accepted, in digits.
MAX_INT_DIGITS = 100
#: Bodies up to this size are decoded on the event loop (well under a millisecond).
_INLINE_BYTES = 64 * 1024
_SURROGATE = re.compile("[\ud800-\udfff]")


async def decode_json(raw: bytes, limiter: anyio.CapacityLimiter) -> dict[str, Any]:
    """The JSON object of a body (see the module's table); large ones in a thread."""
    if len(raw) <= _INLINE_BYTES:
        return parse_json(raw)
    return await anyio.to_thread.run_sync(parse_json, raw, limiter=limiter)


def parse_json(raw: bytes) -> dict[str, Any]:
    """The JSON object of a body, or a 400 saying why not."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(f"the request body is not UTF-8: {exc.reason} at byte {exc.start}") from None
    body = parse_json_text(text, "the request body")
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_json_text(text: str, what: str) -> object:
    """JSON ``text`` decoded under the body's limits (numbers, nesting, surrogates), for
    the body and for JSON sent inside one of its strings (a schema as a string).

    Raises:
        APIError: naming ``what`` and why it is refused.
    """
    try:
        value = json.loads(
            text,
            parse_constant=_refuse_constant,
            parse_float=_finite_float,
            parse_int=_short_int,
        )
    except json.JSONDecodeError as exc:
        raise APIError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise _too_deep(what) from None
    _check_tree(value, what)
    return value


def _check_tree(body: object, what: str = "the request body") -> None:
    """Refuse nesting deeper than MAX_DEPTH and strings holding lone surrogates."""
    pending: list[tuple[object, int]] = [(body, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise APIError(
                    f"{what} holds a lone UTF-16 surrogate (such as \\ud800): "
                    "text must be valid Unicode"
                )
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_DEPTH:
            raise _too_deep(what)
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        pending.extend((item, depth + 1) for item in items)


def _refuse_constant(name: str) -> float:
    raise APIError(f"{name} is not a JSON number; numbers must be finite")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise APIError(f"the number {text[:40]} is out of range; numbers must be finite")
    return value


def _short_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise APIError(
            f"an integer of {len(text.lstrip('-'))} digits is too long "
            f"(at most {MAX_INT_DIGITS} digits)"
        )
    return int(text)


def _too_deep(what: str = "the request body") -> APIError:
    return APIError(f"{what} nests arrays or objects deeper than {MAX_DEPTH} levels")
