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

    def full(
        self,
        text: str,
        finish_reason: str | None,
        usage: Usage,
        *,
        logprobs: dict[str, Any] | None = None,
        prompt_logprobs: list[Any] | None = None,
    ) -> dict[str, Any]:
        """The whole response of a non-streamed request.

        ``prompt_logprobs`` (vLLM's extension) goes where vLLM puts it: in the choice of a
        completion, at the top of a chat response; it is left out when None.
        """
        if self.is_chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
            body = self._base("chat.completion")
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
            body = self._base("text_completion")
        body = {**body, "choices": [choice], "usage": usage.body()}
        if prompt_logprobs is not None:
            (body if self.is_chat else choice)["prompt_logprobs"] = prompt_logprobs
        return body

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        *,
        first: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One streamed chunk: a text delta, the logprobs of its tokens, the finish reason
        in the last."""
        if self.is_chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
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
