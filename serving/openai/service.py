"""One OpenAI-style generation request against the engine: prompt, choices, responses.

The HTTP layer (``app.py``) reads and routes; this module owns what happens between a
parsed :class:`GenerationRequest` and response bodies, so it can be used without HTTP::

    submit    model and priority checks (admission.py) -> prompt ids (prompts.py, off
              the loop) -> logit bias and constraint checks -> one engine request per
              choice (n, or best_of), all or none, the copies sharing a parent id (the
              engine caps their slots)
    complete  every choice to its end, concurrently; best_of keeps the n most likely;
              the body built and encoded under max_response_bytes, off the loop when
              its logprobs make it large (response_bodies.py: BodyEncoder)
    stream    every choice's deltas as server-sent events, as they come (a large event,
              such as the echoed prompt's logprobs, built and encoded off the loop)

Leaving early (the client went away) closes the engine streams, which aborts the
requests and frees their pages at once.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

import anyio
import attrs
from tokenizers import Tokenizer

from hybridkv.errors.events import get_logger
from hybridkv.scheduler import (
    CapacityError,
    Engine,
    EngineOverloadedError,
    EngineStoppedError,
    HybridKVError,
    InvalidRequestError,
    RequestStream,
    SamplingParams,
)
from hybridkv.serving.metrics.prometheus import ServerMetrics
from hybridkv.serving.openai.admission import Admission
from hybridkv.serving.openai.choices import Choice
from hybridkv.serving.openai.errors import APIError
from hybridkv.serving.openai.grammar_check import GrammarCheck
from hybridkv.serving.openai.logprobs import LogprobsStream, TokenTexts
from hybridkv.serving.openai.prompts import Prompter
from hybridkv.serving.openai.protocol import GenerationRequest
from hybridkv.serving.openai.response_bodies import (
    DEFAULT_MAX_RESPONSE_BYTES,
    SSE_DONE,
    BodyEncoder,
    ResponseHeader,
    Usage,
    body_is_large,
    output_is_large,
    sse,
    sse_encoded,
)
from hybridkv.serving.openai.text import TextStream, TokenClasses

log = get_logger(__name__)

#: Sends one server-sent event to the client.
Emit = Callable[[bytes], Awaitable[None]]


@attrs.define(kw_only=True)
class Job:
    """A request the engine accepted: its choices and what its response repeats."""

    request: GenerationRequest
    header: ResponseHeader
    choices: list[Choice]
    prompt_ids: list[int]
    arrival: float


class GenerationService:
    """Turns parsed requests into engine requests and engine outputs into responses.

    Args:
        engine: The running engine.
        prompter: The model's tokenizer and chat template, with their limits.
        grammars: How structured output is checked and compiled before queueing.
        model_name: The only ``model`` value requests may name.
        metrics: Where counts go.
        default_max_tokens: Output limit of a chat request that sets none (None: the
            whole context left after the prompt).
        max_response_bytes: Largest response body, or event of a stream; a request
            whose answer would be larger gets a 400 naming the limit.
    """

    def __init__(
        self,
        engine: Engine,
        prompter: Prompter,
        grammars: GrammarCheck,
        *,
        model_name: str,
        metrics: ServerMetrics,
        default_max_tokens: int | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        self.engine = engine
        self.prompter = prompter
        self.grammars = grammars
        self.tokenizer: Tokenizer = prompter.tokenizer
        self.model_name = model_name
        self.max_model_len = prompter.max_model_len
        self.metrics = metrics
        self.default_max_tokens = default_max_tokens
        self.encoder = BodyEncoder(prompter.limiter, max_response_bytes)
        self.token_texts = TokenTexts(self.tokenizer)
        self.token_classes = TokenClasses.of(self.tokenizer)
        self.vocab_size = engine.config.vocab_size or self.tokenizer.get_vocab_size()
        self.admission = Admission(model_name, engine.config, self.vocab_size, grammars)

    def check_model(self, model: str | None) -> None:
        """Refuse (404) a ``model`` this server does not serve."""
        self.admission.check_model(model)

    async def submit(self, request: GenerationRequest) -> Job:
        """Check, tokenize and queue every choice of ``request``.

        Raises:
            APIError: unknown model (404), a priority the scheduling policy refuses, a
                prompt or max_tokens over the context, a bad constraint or logit bias
                (400), or an engine that is full (503).
        """
        self.admission.check_model(request.model)
        self.admission.check_scheduling(request)
        prompt_ids = await self.prompter.token_ids(request)
        await self.admission.check_sampling(request)
        params = [
            request.sampling_params(
                len(prompt_ids), self.max_model_len, self.default_max_tokens, copy=i
            )
            for i in range(request.best_of)
        ]
        response_id = f"{'chatcmpl' if request.is_chat else 'cmpl'}-{uuid.uuid4().hex}"
        if len(params) > 1:  # copies of one request: the engine caps their running slots
            params = [attrs.evolve(p, parent_id=response_id) for p in params]
        streams = self._generate(request, prompt_ids, params, response_id)
        echo_text = self._echo_text(request, prompt_ids)
        choices = [
            Choice(
                i,
                stream,
                TextStream(
                    self.tokenizer,
                    request.stop,
                    include_stop=request.include_stop,
                    skip_special_tokens=request.skip_special_tokens,
                    classes=self.token_classes,
                ),
                logprobs=LogprobsStream.for_request(request, prompt_ids, self.token_texts),
                echo_text=echo_text,
                include_stop=request.include_stop,
                tools=request.tools,
            )
            for i, stream in enumerate(streams)
        ]
        header = ResponseHeader(
            response_id=response_id,
            model=self.model_name,
            created=int(time.time()),
            is_chat=request.is_chat,
        )
        return Job(
            request=request,
            header=header,
            choices=choices,
            prompt_ids=prompt_ids,
            arrival=time.monotonic(),
        )

    async def complete(self, job: Job) -> bytes:
        """Run every choice to its end and return the whole response body, as JSON.

        Raises:
            APIError: a choice failed (500), or the body would pass
                ``max_response_bytes`` (400).
        """
        failures: list[HybridKVError] = []
        async with anyio.create_task_group() as tg:
            for choice in job.choices:
                tg.start_soon(self._run_choice, job, choice, None, failures, tg.cancel_scope)
        if failures:
            raise _failed(failures[0])
        chosen = job.choices
        if job.request.best_of > job.request.n:
            ranked = sorted(chosen, key=lambda c: c.cumulative_logprob, reverse=True)
            chosen = ranked[: job.request.n]
        outputs = [c.last.num_output_tokens for c in chosen if c.last is not None]
        large = body_is_large(
            job.request, len(job.prompt_ids), outputs, sum(len(c.text) for c in chosen)
        )
        return await self.encoder.encode(lambda: self._body(job, chosen), large=large)

    def _body(self, job: Job, chosen: list[Choice]) -> dict[str, Any]:
        """The whole response of the chosen choices (their logprobs taken)."""
        bodies = []
        prompt_logprobs = None
        for index, choice in enumerate(chosen):
            if choice.logprobs is not None and choice.logprobs.prompt_logprobs is not None:
                prompt_logprobs = choice.logprobs.prompt_logprobs
            bodies.append(
                job.header.choice(
                    index,
                    choice.text,
                    choice.finish_reason,
                    logprobs=choice.take_logprobs(),
                    prompt_logprobs=prompt_logprobs if not job.request.is_chat else None,
                    tool_calls=choice.tool_calls,
                )
            )
        return job.header.full(bodies, _usage(job, chosen), prompt_logprobs=prompt_logprobs)

    async def stream(self, job: Job, emit: Emit) -> None:
        """Send every choice's chunks as they come, then the usage (if asked) and
        ``[DONE]``; an engine failure ends the stream with an error event."""
        header = job.header
        if header.is_chat:  # a chat stream opens each choice with the assistant's role
            for choice in job.choices:
                await emit(sse(header.chunk(choice.index, "", first=True)))
        failures: list[HybridKVError] = []
        async with anyio.create_task_group() as tg:
            for choice in job.choices:
                tg.start_soon(self._run_choice, job, choice, emit, failures, tg.cancel_scope)
        if failures:
            await emit(sse(_failed(failures[0]).body()))
        elif job.request.include_usage:
            await emit(sse(header.usage_chunk(_usage(job, job.choices))))
        await emit(SSE_DONE)

    def close(self, job: Job) -> None:
        """End the job however its response ended: abort the choices still running (the
        client left) and count them."""
        for choice in job.choices:
            choice.stream.close()
            if not choice.is_counted:
                self._count(job, choice, "abort")

    # -- internals ---------------------------------------------------------------------

    async def _run_choice(
        self,
        job: Job,
        choice: Choice,
        emit: Emit | None,
        failures: list[HybridKVError],
        scope: anyio.CancelScope,
    ) -> None:
        """Read one choice to its end; with ``emit``, stream its chunks on the way."""
        header = job.header
        delta = ""
        large = False  # an output whose logprobs are built off the loop
        try:
            async with aclosing(choice.stream) as outputs:
                async for out in outputs:
                    self._observe(job, choice, out)
                    large = output_is_large(job.request, len(job.prompt_ids), out)
                    if large:  # the prompt's logprobs: thousands of entries
                        delta = await self.encoder.off_loop(choice.push, out)
                    else:
                        delta = choice.push(out)
                    if choice.is_done:
                        break  # leaving the stream early aborts the request (stop string)
                    if emit is not None and delta:  # tokens without text keep their logprobs
                        usage = _usage(job, job.choices) if job.request.continuous_usage else None
                        chunk = functools.partial(_chunk, header, choice, delta, usage=usage)
                        await emit(sse_encoded(await self.encoder.encode(chunk, large=large)))
                        delta = ""
        except HybridKVError as exc:
            self._count(job, choice, "error")
            failures.append(exc)
            scope.cancel()  # one failed choice fails the response
            return
        assert choice.last is not None, "the engine ends every request with an output"
        tail = choice.finish()
        self._finish(job, choice)
        if emit is not None:
            usage = _usage(job, job.choices) if job.request.continuous_usage else None
            chunk = functools.partial(
                _chunk, header, choice, delta + tail, choice.finish_reason, usage=usage
            )
            try:
                event = await self.encoder.encode(chunk, large=large)
            except APIError as exc:  # the last event is over the limit: the stream fails
                failures.append(exc)
                scope.cancel()
                return
            await emit(sse_encoded(event))

    def _generate(
        self,
        request: GenerationRequest,
        prompt_ids: list[int],
        params: list[SamplingParams],
        response_id: str,
    ) -> list[RequestStream]:
        """One engine request per choice, or none: a refusal aborts the ones queued."""
        streams: list[RequestStream] = []
        try:
            for i, choice_params in enumerate(params):
                rid = response_id if len(params) == 1 else f"{response_id}-{i}"
                streams.append(
                    self.engine.generate(
                        prompt_ids,
                        choice_params,
                        request_id=rid,
                        priority=request.priority,
                        cache_salt=request.cache_salt,
                        speculative=request.speculative,
                    )
                )
        except (EngineOverloadedError, EngineStoppedError) as exc:
            self._abort(streams)
            raise APIError(str(exc), status=503, error_type="server_overloaded") from exc
        except (InvalidRequestError, CapacityError) as exc:
            self._abort(streams)
            raise APIError(str(exc), param="prompt") from exc
        return streams

    def _abort(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            stream.close()

    def _echo_text(self, request: GenerationRequest, prompt_ids: list[int]) -> str:
        if not request.echo:
            return ""
        if isinstance(request.prompt, str):
            return request.prompt
        return self.tokenizer.decode(prompt_ids)

    def _observe(self, job: Job, choice: Choice, out: Any) -> None:
        if not out.new_token_ids:
            return
        now = time.monotonic()
        if out.num_output_tokens == len(out.new_token_ids):
            self.metrics.time_to_first_token.observe(now - job.arrival)
        self.metrics.generation_tokens.inc(len(out.new_token_ids))
        last = choice.last_token_at
        self.metrics.vllm.tokens(out, now - job.arrival, None if last is None else now - last)
        choice.last_token_at = now

    def _finish(self, job: Job, choice: Choice) -> None:
        last = choice.last
        assert last is not None
        self.metrics.prompt_tokens.inc(last.num_prompt_tokens)
        self.metrics.cached_prompt_tokens.inc(last.num_cached_tokens)
        self._count(job, choice, choice.finish_reason or "unknown")

    def _count(self, job: Job, choice: Choice, reason: str) -> None:
        choice.is_counted = True
        self.metrics.finished.labels(reason=reason).inc()
        if choice.last is not None:
            self.metrics.vllm.ended(choice.last, reason, time.monotonic() - job.arrival)


def _chunk(
    header: ResponseHeader,
    choice: Choice,
    text: str,
    finish_reason: str | None = None,
    *,
    usage: Usage | None = None,
) -> dict[str, Any]:
    """One streamed chunk of ``choice``, with the logprobs gathered since the last (and
    the usage so far, where every chunk carries it)."""
    calls = choice.tool_calls if finish_reason is not None else ()
    chunk = header.chunk(
        choice.index, text, finish_reason, logprobs=choice.take_logprobs(), tool_calls=calls
    )
    if usage is not None:
        chunk["usage"] = usage.body()
    return chunk


def _failed(exc: HybridKVError) -> APIError:
    if isinstance(exc, APIError):  # a refusal of the answer itself (too large)
        return exc
    return APIError(f"generation failed: {exc}", status=500, error_type="server_error")


def _usage(job: Job, choices: list[Choice]) -> Usage:
    outputs = [c.last for c in choices if c.last is not None]
    return Usage(
        prompt_tokens=len(job.prompt_ids),
        completion_tokens=sum(o.num_output_tokens for o in outputs),
        cached_tokens=outputs[0].num_cached_tokens if outputs else 0,
    )
