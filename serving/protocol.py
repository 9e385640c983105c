"""OpenAI-style request bodies in, checked values out; errors as OpenAI error bodies.

Parsing is strict about types and ranges (a wrong value is a 400 naming the field) and
lenient about unknown fields (ignored, as OpenAI clients send many optional ones).
Values that depend on the prompt's length (``max_tokens`` against the context) are
checked by :meth:`GenerationRequest.sampling_params` once the prompt is tokenized.

Log-probabilities: completions take ``logprobs`` (an int) and ``echo``; chat takes
``logprobs`` (a bool) and ``top_logprobs``; both take vLLM's ``prompt_logprobs``. Each
becomes one count in :class:`GenerationRequest` (None: not asked).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from hybridkv.errors import HybridKVError
from hybridkv.scheduler.params import MAX_LOGPROBS, SamplingParams


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


def error_body(
    message: str, error_type: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """An OpenAI-style error body."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """A parsed ``/v1/completions`` or ``/v1/chat/completions`` body.

    Exactly one of ``prompt`` (a string or token ids) and ``messages`` is set.

    Attributes:
        logprobs: Top tokens to report beside each generated token's logprob (completions'
            ``logprobs``, chat's ``top_logprobs`` once ``logprobs`` is true); None: none.
        prompt_logprobs: vLLM's ``prompt_logprobs``: the same for each prompt token.
        echo: The prompt leads the text (and the logprobs lists, with ``logprobs``).
    """

    model: str
    prompt: str | tuple[int, ...] | None = None
    messages: tuple[Mapping[str, str], ...] | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    echo: bool = False

    @property
    def is_chat(self) -> bool:
        """Whether this came from the chat endpoint."""
        return self.messages is not None

    def sampling_params(
        self, num_prompt_tokens: int, max_model_len: int, default_max_tokens: int | None
    ) -> SamplingParams:
        """The engine's parameters, ``max_tokens`` checked against the context left.

        Without ``max_tokens`` the request may use ``default_max_tokens`` or, if that is
        None, the whole context left after its prompt.

        Raises:
            APIError: the prompt fills the context, or max_tokens does not fit after it.
        """
        room = max_model_len - num_prompt_tokens
        if room < 1:
            raise APIError(
                f"the prompt has {num_prompt_tokens} tokens; this model's context is "
                f"{max_model_len} tokens, prompt and output together",
                param="messages" if self.is_chat else "prompt",
                code="context_length_exceeded",
            )
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = room if default_max_tokens is None else min(room, default_max_tokens)
        elif max_tokens > room:
            raise APIError(
                f"max_tokens={max_tokens} plus the prompt's {num_prompt_tokens} tokens exceed "
                f"this model's context of {max_model_len} tokens (at most {room} fit)",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            prompt_logprobs=self._engine_prompt_logprobs(),
        )

    def _engine_prompt_logprobs(self) -> int | None:
        # Echo with logprobs reports the prompt tokens too, so the engine must compute them.
        counts = [self.prompt_logprobs, self.logprobs if self.echo else None]
        return max((c for c in counts if c is not None), default=None)


#: Fields we do not implement, and the values that ask for nothing (so are accepted).
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "best_of": (None, 1),
    "tools": (None, []),
}


def parse_json(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_completion(body: Mapping[str, Any]) -> GenerationRequest:
    """A ``/v1/completions`` body (``max_tokens`` defaults to 16, as OpenAI's does)."""
    return GenerationRequest(
        prompt=_prompt(body),
        logprobs=_num_logprobs(body, "logprobs"),
        echo=_bool(body, "echo", False),
        **_common(body, default_max_tokens=16),
    )


def parse_chat(body: Mapping[str, Any]) -> GenerationRequest:
    """A ``/v1/chat/completions`` body."""
    if body.get("echo") not in (None, False):
        raise APIError("'echo' is not supported by this server for chat", param="echo")
    top_logprobs = _num_logprobs(body, "top_logprobs")
    if not _bool(body, "logprobs", False):
        # OpenAI's rule; 0 asks for nothing, so vLLM accepts it alone, and so do we.
        if top_logprobs:
            raise APIError(
                f"top_logprobs={top_logprobs} needs 'logprobs' set to true",
                param="top_logprobs",
            )
        top_logprobs = None
    elif top_logprobs is None:
        top_logprobs = 0
    return GenerationRequest(
        messages=_messages(body),
        logprobs=top_logprobs,
        **_common(body, default_max_tokens=None),
    )


def _common(body: Mapping[str, Any], default_max_tokens: int | None) -> dict[str, Any]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError("'model' must be a non-empty string", param="model")
    n = _int(body, "n", 1)
    if n != 1:
        raise APIError(f"n={n} is not supported; only n=1 is", param="n")
    for field, allowed in _UNSUPPORTED.items():
        if body.get(field) not in allowed:
            raise APIError(f"'{field}' is not supported by this server", param=field)
    max_tokens = _optional_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _optional_int(body, "max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise APIError(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError("'stream_options' must be an object", param="stream_options")
    stream = _bool(body, "stream", False)
    prompt_logprobs = _num_logprobs(body, "prompt_logprobs")
    if stream and prompt_logprobs is not None:
        # As vLLM: they would arrive only once the whole prompt has run.
        raise APIError(
            "'prompt_logprobs' is not available with stream=true", param="prompt_logprobs"
        )
    return {
        "model": model,
        "max_tokens": max_tokens,
        "min_tokens": _int(body, "min_tokens", 0, minimum=0),
        "temperature": _float(body, "temperature", 1.0, low=0.0, high=2.0),
        "top_p": _float(body, "top_p", 1.0, low=0.0, high=1.0, open_low=True),
        "top_k": _top_k(body),
        "seed": _optional_int(body, "seed"),
        "stop": _stop(body),
        "stop_token_ids": tuple(_int_list(body.get("stop_token_ids") or [], "stop_token_ids")),
        "ignore_eos": _bool(body, "ignore_eos", False),
        "stream": stream,
        "include_usage": _bool(options, "include_usage", False),
        "prompt_logprobs": prompt_logprobs,
    }


def _prompt(body: Mapping[str, Any]) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise APIError(
            f"a batch of {len(prompt)} prompts is not supported; send one request per prompt",
            param="prompt",
        )
    raise APIError("'prompt' must be a non-empty string or list of token ids", param="prompt")


def _messages(body: Mapping[str, Any]) -> tuple[Mapping[str, str], ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(f"messages[{i}] must be an object with a 'role'", param="messages")
        out.append({"role": message["role"], "content": _content(message.get("content"), i)})
    return tuple(out)


def _content(content: object, index: int) -> str:
    if isinstance(content, str):
        return content
    # The list form: text parts only.
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise APIError(
        f"messages[{index}].content must be a string or a list of text parts",
        param="messages",
    )


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise APIError("'stop' must be a non-empty string or a list of them", param="stop")
    return tuple(stop)


def _top_k(body: Mapping[str, Any]) -> int:
    top_k = _int(body, "top_k", 0)
    if top_k < -1:
        raise APIError(f"top_k must be >= 0 (0 or -1 keep all), got {top_k}", param="top_k")
    return max(top_k, 0)


def _num_logprobs(body: Mapping[str, Any], name: str) -> int | None:
    value = _optional_int(body, name)
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(f"'{name}' must be in [0, {MAX_LOGPROBS}], got {value}", param=name)
    return value


def _optional_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int:
        raise APIError(f"'{name}' must be an integer, got {value!r}", param=name)
    return value


def _int(body: Mapping[str, Any], name: str, default: int, *, minimum: int | None = None) -> int:
    value = _optional_int(body, name)
    if value is None:
        return default
    if minimum is not None and value < minimum:
        raise APIError(f"'{name}' must be >= {minimum}, got {value}", param=name)
    return value


def _int_list(value: object, name: str) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise APIError(f"'{name}' must be a list of token ids", param=name)
    return value


def _float(
    body: Mapping[str, Any],
    name: str,
    default: float,
    *,
    low: float,
    high: float,
    open_low: bool = False,
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if type(value) not in (int, float):
        raise APIError(f"'{name}' must be a number, got {value!r}", param=name)
    if value < low or value > high or (open_low and value == low):
        bound = "(" if open_low else "["
        raise APIError(f"'{name}' must be in {bound}{low}, {high}], got {value}", param=name)
    return float(value)


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(f"'{name}' must be true or false, got {value!r}", param=name)
    return value
