"""Request bodies in: the media type, and the size and time limits (the JSON inside is
decoded by ``openai/json_text.py``).

Every way a body can be wrong is a 4xx with an OpenAI error body, never a 500::

    Content-Type not application/json   415   (a form post from any web page is refused)
    more than max_bytes                 413   (as soon as the size is known)
    slower than timeout_s               408

A client that disconnects mid-upload raises :class:`ClientGoneError`, which the routes log
once at info level.
"""

from __future__ import annotations

import anyio
from starlette.requests import ClientDisconnect, Request

from hybridkv.serving.openai.errors import APIError, ClientGoneError


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


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        f"the request body has at least {size} bytes; the limit is {limit}",
        status=413,
        code="request_too_large",
    )
