"""The error every refusal of the HTTP layer raises, and its OpenAI-style body.

Routes catch :class:`APIError` and answer ``status`` with :meth:`APIError.body`::

    {"error": {"message": "'top_p' must be in (0.0, 1.0], got 0", "type":
               "invalid_request_error", "param": "top_p", "code": null}}
"""

from __future__ import annotations

from typing import Any

from hybridkv.errors import HybridKVError


class APIError(HybridKVError):
    """A request the server refuses; rendered as an OpenAI error body with ``status``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        error_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.message, self.error_type, param=self.param, code=self.code)


class ClientGoneError(HybridKVError):
    """The client disconnected before its request was read: nobody reads an answer."""


def error_body(
    message: str, error_type: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """An OpenAI-style error body."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
