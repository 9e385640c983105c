"""One choice of a response: an engine request's outputs turned into text and logprobs.

A request with ``n`` (or ``best_of``) choices runs that many engine requests with the
same prompt (the prefix cache lets the copies share its pages); each has a
:class:`Choice`. A choice reads its engine stream, cuts the text at stop strings, keeps
its logprobs, and knows how it ended::

    engine output  (7, 12)     -> text stream -> "The sea" | held back " i"
    engine output  (4, <eos>)  -> finish "stop": the stop token's text is left out
                                  unless include_stop_str_in_output
"""

from __future__ import annotations

from typing import Any

from hybridkv.scheduler import FinishReason, RequestOutput, RequestStream
from hybridkv.serving.openai.logprobs import LogprobsStream
from hybridkv.serving.openai.text import TextStream
from hybridkv.serving.openai.tools import ToolSpec


class Choice:
    """The state of one choice while its engine request runs.

    Args:
        index: Its place among the response's choices.
        stream: The engine request's outputs (closing it aborts the request).
        texts: Its detokenizer, with the request's stop strings.
        logprobs: Its logprobs, if the request asks for them.
        echo_text: The prompt's text, which leads the output with ``echo``.
        include_stop: Keep the text of a stop token that ends the output.

    Attributes:
        last: The latest engine output (None before the first).
        cumulative_logprob: Sum of the sampled tokens' logprobs (when the engine
            reports them): how ``best_of`` ranks choices.
        is_counted: Its end went into the metrics.
    """

    def __init__(
        self,
        index: int,
        stream: RequestStream,
        texts: TextStream,
        *,
        logprobs: LogprobsStream | None = None,
        echo_text: str = "",
        include_stop: bool = False,
        tools: ToolSpec | None = None,
    ) -> None:
        self.index = index
        self.stream = stream
        self.texts = texts
        self.logprobs = logprobs
        self._head = echo_text
        self._include_stop = include_stop
        self._parts: list[str] = []
        self.last: RequestOutput | None = None
        self.cumulative_logprob = 0.0
        self.is_counted = False
        self.last_token_at: float | None = None  # monotonic time of the latest token
        self._tools = tools
        self._sent = 0  # with tools: characters of the text streamed as content so far
        self._pending = ""  # with tools: the text after those, held back
        #: With tools, once finished: the calls the text made (OpenAI's ``tool_calls``).
        self.tool_calls: list[dict[str, Any]] = []

    @property
    def is_done(self) -> bool:
        """The engine request ended, or a stop string ended the text."""
        return self.texts.is_stopped or (self.last is not None and self.last.is_finished)

    def push(self, out: RequestOutput) -> str:
        """Take one engine output; the text it makes safe to emit (the echoed prompt
        leads the first)."""
        self.last = out
        if out.logprobs:
            self.cumulative_logprob += sum(entry.logprob for entry in out.logprobs)
        token_ids = out.new_token_ids
        if out.finish_reason is FinishReason.STOP and token_ids and not self._include_stop:
            token_ids = token_ids[:-1]  # the EOS or stop token ended it: not part of the text
        delta, self._head = self._head + self.texts.push(token_ids), ""
        if self.logprobs is not None:
            self.logprobs.push(out)
        self._parts.append(delta)
        return self._content_delta()

    def finish(self) -> str:
        """The text held back until the end (with tools: the content's rest; the calls
        go to :attr:`tool_calls`)."""
        self._parts.append(self.texts.finish())
        if self._tools is None:
            return self._parts[-1]
        content, self.tool_calls = self._tools.calls(self.raw_text)
        tail = (content or "")[self._sent :]
        self._sent += len(tail)
        return tail

    @property
    def raw_text(self) -> str:
        """The text the model wrote, tool calls included."""
        return "".join(self._parts)

    @property
    def text(self) -> str:
        """The content: everything :meth:`push` and :meth:`finish` returned."""
        if self._tools is None:
            return self.raw_text
        return self.raw_text[: self._sent] if self.tool_calls else self.raw_text

    def _content_delta(self) -> str:
        if self._tools is None:
            return self._parts[-1]
        pending = self._pending + self._parts[-1]
        safe = self._tools.held(pending, started=self._sent > 0)
        delta, self._pending = pending[:safe], pending[safe:]
        self._sent += safe
        return delta

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish reason: ``stop`` (a stop string, EOS or stop token),
        ``length``, or the engine's reason for any other end."""
        if self.tool_calls:
            return "tool_calls"
        if self.texts.is_stopped:
            return "stop"
        last = self.last
        return None if last is None or last.finish_reason is None else str(last.finish_reason)

    def take_logprobs(self) -> dict[str, Any] | None:
        """The logprobs gathered since the last call (None if the request asks none)."""
        return None if self.logprobs is None else self.logprobs.take()
