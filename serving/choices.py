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
from hybridkv.serving.logprobs import LogprobsStream
from hybridkv.serving.text import TextStream


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
        return delta

    def finish(self) -> str:
        """The text held back until the end."""
        tail = self.texts.finish()
        self._parts.append(tail)
        return tail

    @property
    def text(self) -> str:
        """Everything :meth:`push` and :meth:`finish` returned."""
        return "".join(self._parts)

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish reason: ``stop`` (a stop string, EOS or stop token),
        ``length``, or the engine's reason for any other end."""
        if self.texts.is_stopped:
            return "stop"
        last = self.last
        return None if last is None or last.finish_reason is None else str(last.finish_reason)

    def take_logprobs(self) -> dict[str, Any] | None:
        """The logprobs gathered since the last call (None if the request asks none)."""
        return None if self.logprobs is None else self.logprobs.take()
