"""Request bodies in: the media type, the size and time limits, strict JSON decoding.

Every way a body can be wrong is a 4xx with an OpenAI error body, never a 500::

    Content-Type not application/json   415   (a form post from any web page is refused)
    more than max_bytes                 413   (as soon as the size is known)
    slower than timeout_s               408
    not UTF-8, not JSON, not an object  400
    NaN, Infinity, 1e999                400   (not JSON numbers; NaN used to reach the sampler)
    an integer literal over 100 digits  400   (Python's limit raised a 500)
    nesting deeper than 64              400   (100k brackets raised RecursionError)
    a lone surrogate (\\ud800)           400   (the tokenizer cannot encode it)

A client that disconnects mid-upload raises :class:`ClientGoneError`, which the routes log
once at info level. Large bodies are decoded in a worker thread.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import anyio
from starlette.requests import ClientDisconnect, Request

from hybridkv.serving.errors import APIError, ClientGoneError

#: Deepest nesting of arrays and objects accepted.
MAX_DEPTH = 64
#: Longest integer literal accepted, in digits.
MAX_INT_DIGITS = 100
#: Bodies up to this size are decoded on the event loop (well under a millisecond).
_INLINE_BYTES = 64 * 1024
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_json_media_type(request: Request) -> None:
    """Refuse (415) a body whose Content-Type is not ``application/json``."""
    content_type = request.headers.get("content-type", "")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        shown = content_type or "none"
        raise APIError(
            f"Content-Type must be application/json, got {shown}",
            status=415,
            code="unsupported_media_type",
        )


async def read_body(request: Request, *, max_bytes: int, timeout_s: float) -> bytes:
    """The body, refused with 413 once it is known to exceed ``max_bytes`` and with 408
    if it takes longer than ``timeout_s`` to arrive.

    Raises:
        APIError: too large or too slow.
        ClientGoneError: the client disconnected before the body was complete.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    body = bytearray()
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > max_bytes:
                    raise _too_large(len(body), max_bytes)
    except TimeoutError:
        raise APIError(
            f"the request body did not arrive within {timeout_s:g} s ({len(body)} bytes came)",
            status=408,
            code="request_timeout",
        ) from None
    except ClientDisconnect:
        raise ClientGoneError("the client disconnected while sending its request") from None
    return bytes(body)


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


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        f"the request body has at least {size} bytes; the limit is {limit}",
        status=413,
        code="request_too_large",
    )
