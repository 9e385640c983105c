"""Who may talk to the server: an optional Host allow-list, an optional API key, and the
web origins CORS lets in (:func:`cors`).

Pure ASGI middleware (no response buffering, so streams and disconnects pass through)::

    Host not in allowed_hosts        400 invalid_host      every path
    no "Authorization: Bearer KEY"   401 invalid_api_key   /v1/*, /tokenize, /detokenize

The Host check stops DNS rebinding: a web page whose name resolves to 127.0.0.1 sends
its own name as Host. The key is compared in constant time. As in vLLM, ``/health``,
``/metrics`` and ``/version`` stay open for monitoring; unlike vLLM, ``/tokenize`` and
``/detokenize`` need the key too (they run the chat template and the tokenizer).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Sequence

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Receive, Scope, Send

from hybridkv.serving.openai.errors import error_body

_KEYED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


def host_name(host_header: str) -> str:
    """The name in a Host header, without the port (``[::1]:8000`` -> ``::1``)."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_allowed_host(name: str, allowed: Sequence[str]) -> bool:
    """Whether ``name`` matches an entry (``*.example.com`` matches subdomains)."""
    for pattern in allowed:
        pattern = pattern.lower()
        if pattern == "*" or name == pattern:
            return True
        if pattern.startswith("*.") and name.endswith(pattern[1:]):
            return True
    return False


class KeyCheck:
    """Whether a request carries the API key (``Authorization: Bearer <key>``, compared
    in constant time); every request passes where no key is set."""

    def __init__(self, api_key: str | None) -> None:
        self._key = None if api_key is None else api_key.encode()

    @property
    def is_set(self) -> bool:
        return self._key is not None

    def passes(self, headers: Headers) -> bool:
        if self._key is None:
            return True
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._key)


class AccessGuard:
    """Refuses requests with a Host not allowed, or without the API key where needed.

    Args:
        app: The app behind it.
        api_key: The key clients send as ``Authorization: Bearer <key>``; None: none.
        allowed_hosts: Host names accepted; empty: any.
    """

    def __init__(self, app: ASGIApp, *, api_key: str | None, allowed_hosts: Sequence[str]) -> None:
        self.app = app
        self._key = KeyCheck(api_key)
        self._hosts = tuple(allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self._hosts:
            name = host_name(headers.get("host", ""))
            if not is_allowed_host(name, self._hosts):
                message = f"the Host header {name!r} is not one this server answers to"
                await _refuse(send, 400, message, "invalid_host", "invalid_request_error")
                return
        if self._key.is_set and scope["method"] != "OPTIONS":
            path: str = scope["path"]
            if path.startswith(_KEYED_PREFIXES) and not self._key.passes(headers):
                message = "a valid API key is required: send 'Authorization: Bearer <key>'"
                await _refuse(send, 401, message, "invalid_api_key", "invalid_request_error")
                return
        await self.app(scope, receive, send)


async def _refuse(send: Send, status: int, message: str, code: str, error_type: str) -> None:
    body = json.dumps(error_body(message, error_type, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def cors(origins: tuple[str, ...]) -> list[Middleware]:
    """Starlette's CORS middleware for ``origins`` (it answers preflights itself, before
    the access guard: a browser sends no key with one), or none."""
    if not origins:
        return []
    from starlette.middleware.cors import CORSMiddleware

    return [
        Middleware(
            CORSMiddleware, allow_origins=list(origins), allow_methods=["*"], allow_headers=["*"]
        )
    ]
