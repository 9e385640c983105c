"""OpenAI-style response bodies for completions and chat, whole and streamed (SSE), and
their JSON encoding under a size limit.

A body with logprobs can be large: ``echo`` with ``logprobs: 20`` on an 8k-token prompt is
some 15 MB of JSON. A body (or a streamed event) with more than :data:`INLINE_ENTRIES`
logprob entries (a token's or a top token's), or more than :data:`SMALL_BYTES` of text, is
built and encoded in a worker thread (:class:`BodyEncoder`). :func:`encode_json` encodes
in pieces, so that the event loop runs between them (one ``json.dumps`` call holds the GIL
from start to end, however long the body), and it stops once the encoded size passes the
limit instead of building an unbounded body::

    small (a bounded walk says so)    one json.dumps
    large                             containers walked, small parts dumped whole,
                                      the bytes counted as they come: over the limit ->
                                      ResponseTooLargeError
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import attrs

from hybridkv.errors import HybridKVError
from hybridkv.scheduler import RequestOutput
from hybridkv.serving.openai.errors import APIError
from hybridkv.serving.openai.protocol import GenerationRequest

#: Most logprob entries a body or event is built with on the event loop.
INLINE_ENTRIES = 1024
#: The default limit of one response body, or of one event of a stream.
DEFAULT_MAX_RESPONSE_BYTES = 64 * 2**20

#: Bodies whose bounded walk counts at most this many bytes are encoded in one call.
SMALL_BYTES = 64 * 1024
#: Rough bytes of a number, null or boolean, and of a container's brackets and commas:
#: what the walk counts besides strings (an estimate; the encoder counts exactly).
_SCALAR_BYTES = 8
#: Largest part (by the walk's count) dumped in one call by the piecewise encoder.
_PIECE_BYTES = 16 * 1024


def output_is_large(request: GenerationRequest, num_prompt: int, out: RequestOutput) -> bool:
    """Whether an engine output brings more logprob entries than the loop builds: the
    prompt's, with ``prompt_logprobs`` or ``echo`` and ``logprobs``."""
    if out.prompt_logprobs is None:
        return False
    width = max(
        -1 if request.prompt_logprobs is None else request.prompt_logprobs,
        -1 if request.logprobs is None or not request.echo else request.logprobs,
    )
    return width >= 0 and num_prompt * (width + 1) > INLINE_ENTRIES


def body_is_large(
    request: GenerationRequest, num_prompt: int, num_outputs: Sequence[int], num_chars: int
) -> bool:
    """Whether a whole body is built off the loop: the logprob entries of its choices
    (``num_outputs`` tokens each) and of its prompt, and its ``num_chars`` of text."""
    entries = 0
    if request.logprobs is not None:
        tokens = sum(num_outputs) + (num_prompt * len(num_outputs) if request.echo else 0)
        entries += tokens * (request.logprobs + 1)
    if request.prompt_logprobs is not None:
        entries += num_prompt * (request.prompt_logprobs + 1)
    return entries > INLINE_ENTRIES or num_chars > SMALL_BYTES


class BodyEncoder:
    """Builds and encodes bodies and events under a size limit, large ones in a worker
    thread of ``limiter`` (the app's preprocessing threads)."""

    def __init__(self, limiter: anyio.CapacityLimiter, max_bytes: int) -> None:
        self.limiter = limiter
        self.max_bytes = max_bytes

    async def off_loop(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)`` in a worker thread."""
        return await anyio.to_thread.run_sync(function, *args, limiter=self.limiter)

    async def encode(self, build: Callable[[], Any], *, large: bool) -> bytes:
        """The JSON of what ``build`` returns, built and encoded in a worker thread when
        ``large``, on the loop otherwise.

        Raises:
            APIError: the JSON would pass ``max_bytes`` (400, naming the limit).
        """
        limit = self.max_bytes

        def run() -> bytes:
            return encode_json(build(), limit)

        try:
            return await self.off_loop(run) if large else run()
        except ResponseTooLargeError as exc:
            raise APIError(
                f"the response would be larger than this server's limit of {exc.limit} bytes "
                "(--max-response-size); ask for fewer logprobs, prompt_logprobs or choices, "
                "or fewer tokens",
                code="response_too_large",
            ) from None


class ResponseTooLargeError(HybridKVError):
    """A response body would exceed the server's limit (``--max-response-size``)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the response body would exceed {limit} bytes")
        self.limit = limit


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
        tool_calls: Sequence[Mapping[str, Any]] = (),
    ) -> dict[str, Any]:
        """One choice of a whole response.

        ``prompt_logprobs`` (vLLM's extension) goes in the choice of a completion; a chat
        response carries it at the top (see :meth:`full`). It is left out when None. A
        chat message with ``tool_calls`` has no content unless text came before them.
        """
        if self.is_chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                message["content"] = text if text.strip() else None
                message["tool_calls"] = [dict(c) for c in tool_calls]
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
        tool_calls: Sequence[Mapping[str, Any]] = (),
    ) -> dict[str, Any]:
        """One streamed chunk of choice ``index``: a text delta, the logprobs of its
        tokens, the finish reason in the last."""
        if self.is_chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            if tool_calls:  # each call whole, in the last chunk
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(tool_calls)]
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


def sse_encoded(payload: bytes) -> bytes:
    """One server-sent event around JSON already encoded (:func:`encode_json`)."""
    return b"data: " + payload + b"\n\n"


SSE_DONE = sse("[DONE]")


def is_small(value: object, limit: int = SMALL_BYTES) -> bool:
    """Whether ``value`` encodes to about ``limit`` bytes or fewer, by a walk that stops
    as soon as it has counted more (so it costs at most ``limit`` bytes' worth of nodes)."""
    return _walk_size(value, limit) <= limit


def encode_json(value: object, max_bytes: int) -> bytes:
    """``value`` as compact UTF-8 JSON (as Starlette's ``JSONResponse`` renders it), in
    pieces when it is large.

    Raises:
        ResponseTooLargeError: the encoding passes ``max_bytes``; it stops there.
    """
    if is_small(value):
        data = _dumps(value).encode()
        if len(data) > max_bytes:
            raise ResponseTooLargeError(max_bytes)
        return data
    out = _Pieces(max_bytes)
    _encode(value, out)
    return b"".join(out.parts)


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class _Pieces:
    """Encoded pieces and their byte count, refused past the limit."""

    def __init__(self, max_bytes: int) -> None:
        self.parts: list[bytes] = []
        self._size = 0
        self._max_bytes = max_bytes

    def add(self, text: str) -> None:
        data = text.encode()
        self._size += len(data)
        if self._size > self._max_bytes:
            raise ResponseTooLargeError(self._max_bytes)
        self.parts.append(data)


def _encode(value: object, out: _Pieces) -> None:
    """Encode ``value`` into ``out``: parts the walk finds small in one call each (runs of
    small list items together), larger containers item by item."""
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        if is_small(value, _PIECE_BYTES):
            out.add(_dumps(value))
            return
        out.add("{")
        for i, (key, item) in enumerate(value.items()):
            out.add(("," if i else "") + _dumps(key) + ":")
            _encode(item, out)
        out.add("}")
    elif isinstance(value, list | tuple):
        out.add("[")
        run: list[object] = []
        run_size = 0
        written = False  # an item is out already: the next one needs a comma
        for item in value:
            size = _walk_size(item, _PIECE_BYTES)
            if run and (run_size + size > _PIECE_BYTES or size > _PIECE_BYTES):
                written = _flush(run, out, written)
                run, run_size = [], 0
            if size <= _PIECE_BYTES:
                run.append(item)
                run_size += size
            else:
                out.add("," if written else "")
                _encode(item, out)
                written = True
        _flush(run, out, written)
        out.add("]")
    else:
        out.add(_dumps(value))


def _flush(run: list[object], out: _Pieces, written: bool) -> bool:
    """Add a run of small list items in one ``json.dumps``; whether any item is out."""
    if not run:
        return written
    out.add(("," if written else "") + _dumps(run)[1:-1])
    return True


def _walk_size(value: object, limit: int) -> int:
    """About the bytes ``value`` encodes to, counted until more than ``limit``.

    Strings count their length, other leaves :data:`_SCALAR_BYTES`; leaves are counted
    where their container is met, so a walk costs about one loop turn per leaf.
    """
    size = 0
    pending = [value]
    while pending:
        item = pending.pop()
        kind = type(item)
        if kind is dict:
            size += 2
            for key, leaf in item.items():  # type: ignore[attr-defined]
                size += (len(key) if type(key) is str else _SCALAR_BYTES) + 4
                if type(leaf) is str:
                    size += len(leaf)
                elif isinstance(leaf, dict | list | tuple):
                    pending.append(leaf)
                else:
                    size += _SCALAR_BYTES
        elif kind is list or kind is tuple:
            size += 2
            for leaf in item:  # type: ignore[attr-defined]
                if type(leaf) is str:
                    size += len(leaf) + 3
                elif isinstance(leaf, dict | list | tuple):
                    pending.append(leaf)
                else:
                    size += _SCALAR_BYTES
        elif kind is str:
            size += len(item) + 2  # type: ignore[arg-type]
        elif isinstance(item, dict | list | tuple):  # a subclass: walked the slow way
            size += 2
            pending.extend(item.values() if isinstance(item, dict) else item)
        else:
            size += _SCALAR_BYTES
        if size > limit:
            return size
    return size
