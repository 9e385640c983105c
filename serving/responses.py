"""OpenAI-style response bodies for completions and chat, whole and streamed (SSE)."""

from __future__ import annotations

import json
from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class Usage:
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def body(self) -> dict[str, Any]:
        """The ``usage`` object."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@attrs.frozen(kw_only=True)
class ResponseHeader:
    """What every body and chunk of one response repeats."""

    response_id: str
    model: str
    created: int
    is_chat: bool

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model}

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        *,
        logprobs: dict[str, Any] | None = None,
        prompt_logprobs: list[Any] | None = None,
    ) -> dict[str, Any]:
        """One choice of a whole response.

        ``prompt_logprobs`` (vLLM's extension) goes in the choice of a completion; a chat
        response carries it at the top (see :meth:`full`). It is left out when None.
        """
        if self.is_chat:
            message = {"role": "assistant", "content": text}
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        return choice

    def full(
        self,
        choices: list[dict[str, Any]],
        usage: Usage,
        *,
        prompt_logprobs: list[Any] | None = None,
    ) -> dict[str, Any]:
        """The whole response of a non-streamed request (a chat's ``prompt_logprobs`` at
        the top, where vLLM puts it)."""
        obj = "chat.completion" if self.is_chat else "text_completion"
        body = {**self._base(obj), "choices": choices, "usage": usage.body()}
        if self.is_chat and prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        return body

    def chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None = None,
        *,
        first: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One streamed chunk of choice ``index``: a text delta, the logprobs of its
        tokens, the finish reason in the last."""
        if self.is_chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        return {**self._base("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The extra last chunk that ``stream_options.include_usage`` asks for."""
        obj = "chat.completion.chunk" if self.is_chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage.body()}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


SSE_DONE = sse("[DONE]")
