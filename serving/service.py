"""One OpenAI-style generation request against the engine: tokenize, submit, stream text.

The HTTP layer (``app.py``) parses and routes; this module owns what happens between a
parsed :class:`GenerationRequest` and response bodies, so it can be used without HTTP.
Leaving a stream early (the client went away) closes the engine's iterator, which aborts
the request and frees its pages at once.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import attrs
import structlog
from tokenizers import Tokenizer

from hybridkv.scheduler import (
    CapacityError,
    Engine,
    EngineOverloadedError,
    EngineStoppedError,
    HybridKVError,
    InvalidRequestError,
    RequestOutput,
    RequestStream,
    SamplingParams,
)
from hybridkv.serving.chat import ChatTemplate
from hybridkv.serving.logprobs import LogprobsStream, TokenTexts
from hybridkv.serving.metrics import ServerMetrics
from hybridkv.serving.protocol import APIError, GenerationRequest
from hybridkv.serving.responses import SSE_DONE, ResponseHeader, Usage, sse
from hybridkv.serving.text import TextStream

log = structlog.get_logger(__name__)


@attrs.define(kw_only=True)
class Submitted:
    """A request the engine accepted, with what its response needs."""

    request: GenerationRequest
    header: ResponseHeader
    stream: RequestStream
    arrival: float
    logprobs: LogprobsStream | None = None  # None: the request asks for none
    echo_text: str = ""  # the prompt's text, with echo
    is_counted: bool = False  # its end went into the metrics


class GenerationService:
    """Turns parsed requests into engine requests and engine outputs into responses.

    Args:
        engine: The running engine.
        tokenizer: The model's tokenizer.
        model_name: The only ``model`` value requests may name.
        max_model_len: Most tokens of prompt and output together.
        chat_template: Renders chat messages into prompt text.
        metrics: Where counts go.
        default_max_tokens: Output limit of a chat request that sets none (None: the
            whole context left after the prompt).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        *,
        model_name: str,
        max_model_len: int,
        chat_template: ChatTemplate,
        metrics: ServerMetrics,
        default_max_tokens: int | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.chat_template = chat_template
        self.metrics = metrics
        self.default_max_tokens = default_max_tokens
        self.token_texts = TokenTexts(tokenizer)

    def submit(self, request: GenerationRequest) -> Submitted:
        """Check, tokenize and queue ``request``.

        Raises:
            APIError: unknown model (404), a prompt or max_tokens over the context (400),
                a request the engine refuses (400), or an engine that is full (503).
        """
        if request.model != self.model_name:
            raise APIError(
                f"the model {request.model!r} does not exist; this server serves "
                f"{self.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )
        prompt_ids = self._tokenize(request)
        params = request.sampling_params(
            len(prompt_ids), self.max_model_len, self.default_max_tokens
        )
        prefix = "chatcmpl" if request.is_chat else "cmpl"
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        stream = self._generate(prompt_ids, params, response_id)
        header = ResponseHeader(
            response_id=response_id,
            model=self.model_name,
            created=int(time.time()),
            is_chat=request.is_chat,
        )
        return Submitted(
            request=request,
            header=header,
            stream=stream,
            arrival=time.monotonic(),
            logprobs=LogprobsStream.for_request(request, prompt_ids, self.token_texts),
            echo_text=self._echo_text(request, prompt_ids),
        )

    async def complete(self, job: Submitted) -> dict[str, object]:
        """Run a request to its end and return the whole response body."""
        texts = TextStream(self.tokenizer, job.request.stop)
        parts: list[str] = []
        last: RequestOutput | None = None
        async with self._closing(job) as outputs:
            try:
                async for last in outputs:
                    self._observe(job, last)
                    parts.append(texts.push(last.new_token_ids))
                    if job.logprobs is not None:
                        job.logprobs.push(last)
                    if texts.is_stopped:
                        break  # leaving the iterator aborts the request
            except HybridKVError as exc:
                self._count(job, "error")
                raise APIError(
                    f"generation failed: {exc}", status=500, error_type="server_error"
                ) from exc
            assert last is not None, "the engine ends every request with an output"
            self._finish(job, last, texts)
        parts.append(texts.finish())
        logprobs, prompt_logprobs = None, None
        if job.logprobs is not None:
            logprobs, prompt_logprobs = job.logprobs.take(), job.logprobs.prompt_logprobs
        return job.header.full(
            job.echo_text + "".join(parts),
            _reason(last, texts),
            _usage(last),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    async def stream(self, job: Submitted) -> AsyncIterator[bytes]:
        """The server-sent events of a streamed request, ``data: [DONE]`` last."""
        header, texts = job.header, TextStream(self.tokenizer, job.request.stop)
        delta, last, head = "", None, job.echo_text
        async with self._closing(job) as outputs:
            if header.is_chat:  # a chat stream opens with the assistant's role
                yield sse(header.chunk("", first=True))
            try:
                async for last in outputs:
                    self._observe(job, last)
                    # The echoed prompt leads the first chunk, beside its logprobs.
                    delta, head = head + texts.push(last.new_token_ids), ""
                    if job.logprobs is not None:
                        job.logprobs.push(last)
                    if last.is_finished or texts.is_stopped:
                        break
                    if delta:  # tokens without text yet keep their logprobs for later
                        yield sse(header.chunk(delta, logprobs=_take(job)))
            except HybridKVError as exc:
                self._count(job, "error")
                yield sse(APIError(f"generation failed: {exc}", error_type="server_error").body())
                yield SSE_DONE
                return
            assert last is not None, "the engine ends every request with an output"
            self._finish(job, last, texts)
        yield sse(header.chunk(delta + texts.finish(), _reason(last, texts), logprobs=_take(job)))
        if job.request.include_usage:
            yield sse(header.usage_chunk(_usage(last)))
        yield SSE_DONE

    # -- internals ---------------------------------------------------------------------

    def _tokenize(self, request: GenerationRequest) -> list[int]:
        if request.messages is not None:
            text = self.chat_template.render(request.messages)
            # A checkpoint's template writes the special tokens itself (BOS included).
            add_special = self.chat_template.is_builtin
            return self.tokenizer.encode(text, add_special_tokens=add_special).ids
        if isinstance(request.prompt, str):
            return self.tokenizer.encode(request.prompt).ids
        assert request.prompt is not None
        return list(request.prompt)

    def _echo_text(self, request: GenerationRequest, prompt_ids: list[int]) -> str:
        if not request.echo:
            return ""
        if isinstance(request.prompt, str):
            return request.prompt
        return self.tokenizer.decode(prompt_ids)

    def _generate(self, prompt_ids: list[int], params: SamplingParams, rid: str) -> RequestStream:
        try:
            return self.engine.generate(prompt_ids, params, request_id=rid)
        except (EngineOverloadedError, EngineStoppedError) as exc:
            raise APIError(str(exc), status=503, error_type="server_overloaded") from exc
        except (InvalidRequestError, CapacityError) as exc:
            raise APIError(str(exc), param="prompt") from exc

    @contextlib.asynccontextmanager
    async def _closing(self, job: Submitted) -> AsyncIterator[RequestStream]:
        """Close the engine's stream however the body ends (closing it aborts)."""
        try:
            async with aclosing(job.stream):
                yield job.stream
        finally:
            if not job.is_counted:  # the client left before the end
                self._count(job, "abort")

    def _observe(self, job: Submitted, out: RequestOutput) -> None:
        if out.new_token_ids and out.num_output_tokens == len(out.new_token_ids):
            self.metrics.time_to_first_token.observe(time.monotonic() - job.arrival)
        self.metrics.generation_tokens.inc(len(out.new_token_ids))

    def _finish(self, job: Submitted, last: RequestOutput, texts: TextStream) -> None:
        self.metrics.prompt_tokens.inc(last.num_prompt_tokens)
        self.metrics.cached_prompt_tokens.inc(last.num_cached_tokens)
        self._count(job, _reason(last, texts) or "unknown")

    def _count(self, job: Submitted, reason: str) -> None:
        job.is_counted = True
        self.metrics.finished.labels(reason=reason).inc()


def _take(job: Submitted) -> dict[str, object] | None:
    return None if job.logprobs is None else job.logprobs.take()


def _reason(last: RequestOutput, texts: TextStream) -> str | None:
    if texts.is_stopped:
        return "stop"
    return None if last.finish_reason is None else str(last.finish_reason)


def _usage(last: RequestOutput) -> Usage:
    return Usage(
        prompt_tokens=last.num_prompt_tokens,
        completion_tokens=last.num_output_tokens,
        cached_tokens=last.num_cached_tokens,
    )
