"""OpenAI-style request bodies in, one checked :class:`GenerationRequest` out.

Every field is read through :class:`~hybridkv.serving.openai.fields.Fields`: a wrong value is a
400 naming the field, a field this server does not implement is a 400 naming it (unless
its value asks for nothing), and a field nobody reads is refused as unrecognized, as
OpenAI does. What vLLM adds to the OpenAI API (``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids``, ``guided_json``, ...) is read the same way.
Values that depend on the prompt's length (``max_tokens`` against the context) are
checked by :meth:`GenerationRequest.sampling_params` once the prompt is tokenized.

Log-probabilities: completions take ``logprobs`` (an int) and ``echo``; chat takes
``logprobs`` (a bool) and ``top_logprobs``; both take vLLM's ``prompt_logprobs``. Each
becomes one count in :class:`GenerationRequest` (None: not asked).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hybridkv.scheduler.params import MAX_LOGPROBS, SamplingParams
from hybridkv.serving.openai.errors import APIError
from hybridkv.serving.openai.fields import Fields
from hybridkv.serving.openai.messages import parse_messages
from hybridkv.serving.openai.sampling_fields import parse_sampling
from hybridkv.serving.openai.structured import parse_structured_output
from hybridkv.serving.openai.tools import ToolSpec, parse_tools

#: Most choices (``n``, ``best_of``) one request may ask for.
MAX_CHOICES = 128


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """A parsed ``/v1/completions`` or ``/v1/chat/completions`` body.

    Exactly one of ``prompt`` (a string or token ids) and ``messages`` is set.

    Attributes:
        sampling: The engine's parameters but for the prompt-dependent ones
            (``max_tokens``, ``min_tokens``, logprob counts), which
            :meth:`sampling_params` sets.
        n: Choices returned.
        best_of: Choices generated; the ``n`` with the highest cumulative logprob are
            returned (``best_of > n`` only without streaming).
        logprobs: Top tokens to report beside each generated token's logprob (completions'
            ``logprobs``, chat's ``top_logprobs`` once ``logprobs`` is true); None: none.
        prompt_logprobs: vLLM's ``prompt_logprobs``: the same for each prompt token.
        echo: The prompt leads the text (and the logprobs lists, with ``logprobs``).
        include_stop: Keep a stop string (or stop token's text) at the end of the text.
        skip_special_tokens: Leave special tokens' text out of the output.
        truncate_prompt_tokens: Keep only the prompt's last this many tokens.
        add_special_tokens: Let the tokenizer add its special tokens (BOS); None: the
            endpoint's default (yes for completions, no for a chat template's text).
        add_generation_prompt: End the chat prompt where the assistant's reply begins.
        template_kwargs: Extra variables for the chat template.
        priority: vLLM's ``priority`` (lower first), any integer here; the service
            checks it against the engine's scheduling policy (only 0 under ``fcfs``, a
            signed 64-bit integer under ``priority``) before anything is queued.
        cache_salt: Separates this request's prefix-cache entries from others'.
        speculative: False opts the request out of speculative decoding (hybridkv's
            field, where the server speculates: ``--speculative-config``).
        structured_param: The field that set ``sampling.structured_output``.
        continuous_usage: Every streamed chunk carries the usage so far (vLLM's
            ``stream_options.continuous_usage_stats``, with ``include_usage``).
        ignored_fields: Fields of the body this server does not know, ignored.
        tools: A chat request's tools and tool choice (``hybridkv.serving.openai.tools``).
    """

    model: str
    prompt: str | tuple[int, ...] | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    n: int = 1
    best_of: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    echo: bool = False
    include_stop: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    template_kwargs: Mapping[str, Any] = attrs.field(factory=dict)
    priority: int = 0
    cache_salt: str | None = None
    speculative: bool = True
    structured_param: str | None = None
    ignored_fields: tuple[str, ...] = ()
    tools: ToolSpec | None = None

    @property
    def is_chat(self) -> bool:
        """Whether this came from the chat endpoint."""
        return self.messages is not None

    def sampling_params(
        self,
        num_prompt_tokens: int,
        max_model_len: int,
        default_max_tokens: int | None,
        *,
        copy: int = 0,
    ) -> SamplingParams:
        """The engine's parameters of choice ``copy``, ``max_tokens`` checked against the
        context left.

        Without ``max_tokens`` the request may use ``default_max_tokens`` or, if that is
        None, the whole context left after its prompt. A seeded request's copies get
        seeds ``seed + copy`` (as vLLM's), so they differ.

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
        seed = self.sampling.seed
        return attrs.evolve(
            self.sampling,
            max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens),
            seed=None if seed is None else seed + copy,
            logprobs=self._engine_logprobs(),
            prompt_logprobs=self._engine_prompt_logprobs(),
        )

    def _engine_logprobs(self) -> int | None:
        # Ranking best_of copies needs each sampled token's logprob.
        if self.logprobs is None and self.best_of > self.n:
            return 0
        return self.logprobs

    def _engine_prompt_logprobs(self) -> int | None:
        # Echo with logprobs reports the prompt tokens too, so the engine must compute them.
        counts = [self.prompt_logprobs, self.logprobs if self.echo else None]
        return max((c for c in counts if c is not None), default=None)


def parse_completion(body: Mapping[str, Any], *, strict: bool = False) -> GenerationRequest:
    """A ``/v1/completions`` body (``max_tokens`` defaults to 16, as OpenAI's does);
    unknown fields are ignored and listed, or with ``strict`` refused."""
    fields = Fields(body, ignored=None if strict else [])
    fields.refuse("suffix", allowed=(None, ""), why="send the text before it as the prompt")
    request = GenerationRequest(
        prompt=_prompt(fields),
        logprobs=_num_logprobs(fields, "logprobs"),
        echo=fields.boolean("echo", False),
        **_common(fields, default_max_tokens=16),
    )
    return _checked(fields, request)


def _checked(fields: Fields, request: GenerationRequest) -> GenerationRequest:
    fields.check_all_read()
    if fields.ignored:
        return attrs.evolve(request, ignored_fields=tuple(sorted(fields.ignored)))
    return request


def parse_chat(
    body: Mapping[str, Any],
    *,
    strict: bool = False,
    tool_parser: str | None = None,
    auto_tools: bool = False,
) -> GenerationRequest:
    """A ``/v1/chat/completions`` body; unknown fields as in :func:`parse_completion`;
    tools as ``hybridkv.serving.openai.tools`` says (``tool_parser``, ``auto_tools``: the
    server's parser of ``auto`` calls, and whether it takes them)."""
    fields = Fields(body, ignored=None if strict else [])
    fields.refuse("echo", allowed=(None, False), why="not for chat")
    top_logprobs = _num_logprobs(fields, "top_logprobs")
    if not fields.boolean("logprobs", False):
        # OpenAI's rule; 0 asks for nothing, so vLLM accepts it alone, and so do we.
        if top_logprobs:
            raise APIError(
                f"top_logprobs={top_logprobs} needs 'logprobs' set to true", param="top_logprobs"
            )
        top_logprobs = None
    elif top_logprobs is None:
        top_logprobs = 0
    tools = parse_tools(fields, parser=tool_parser, auto=auto_tools)
    fields.refuse("continue_final_message", allowed=(None, False))
    fields.refuse("chat_template", why="the server uses the checkpoint's template")
    fields.refuse("documents", allowed=(None, []))
    fields.refuse("modalities", allowed=(None, ["text"]))
    fields.refuse("store", allowed=(None, False))
    fields.raw("metadata")  # kept by OpenAI with store=true only
    template_kwargs = fields.nested("chat_template_kwargs")
    request = GenerationRequest(
        messages=parse_messages(fields),
        logprobs=top_logprobs,
        add_generation_prompt=fields.boolean("add_generation_prompt", True),
        template_kwargs=parse_template_kwargs(template_kwargs),
        tools=tools,
        **_common(fields, default_max_tokens=None),
    )
    constraint = tools.constraint() if tools is not None else None
    if constraint is not None:
        if request.sampling.structured_output is not None:
            raise fields.error("tool_choice", "cannot be combined with a structured output")
        sampling = attrs.evolve(request.sampling, structured_output=constraint)
        request = attrs.evolve(request, sampling=sampling, structured_param="tool_choice")
    return _checked(fields, request)


def _common(fields: Fields, default_max_tokens: int | None) -> dict[str, Any]:
    """The fields both endpoints share."""
    model = fields.string("model")
    if not model:
        raise fields.error("model", "must be a non-empty string")
    max_tokens = fields.optional_integer("max_completion_tokens")
    legacy = fields.optional_integer("max_tokens")
    max_tokens = legacy if max_tokens is None else max_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise fields.error("max_tokens", f"must be >= 1, got {max_tokens}")
    stream = fields.boolean("stream", False)
    options = fields.nested("stream_options")
    include_usage = continuous = False
    if options is not None:
        include_usage = options.boolean("include_usage", False)
        continuous = include_usage and options.boolean("continuous_usage_stats", False)
        options.check_all_read()
    prompt_logprobs = _num_logprobs(fields, "prompt_logprobs")
    if stream and prompt_logprobs is not None:
        # As vLLM: they would arrive only once the whole prompt has run.
        raise fields.error("prompt_logprobs", "is not available with stream=true")
    n, best_of = _choices(fields, stream)
    _refuse_unimplemented(fields)
    fields.raw("user")  # an end-user id for the provider's abuse tracking: nothing to do
    structured = parse_structured_output(fields)
    return {
        "model": model,
        "sampling": parse_sampling(fields, structured[0] if structured else None),
        "max_tokens": max_tokens,
        "min_tokens": fields.integer("min_tokens", 0, low=0),
        "stop": _stop(fields),
        "stream": stream,
        "include_usage": include_usage,
        "continuous_usage": continuous,
        "n": n,
        "best_of": best_of,
        "prompt_logprobs": prompt_logprobs,
        "include_stop": fields.boolean("include_stop_str_in_output", False),
        "skip_special_tokens": fields.boolean("skip_special_tokens", True),
        "truncate_prompt_tokens": _truncate(fields),
        "add_special_tokens": _optional_bool(fields, "add_special_tokens"),
        "priority": fields.integer("priority", 0),
        "cache_salt": fields.string("cache_salt"),
        "speculative": fields.boolean("speculative", True),
        "structured_param": structured[1] if structured else None,
    }


def _refuse_unimplemented(fields: Fields) -> None:
    """vLLM and OpenAI fields this server knows and does not implement."""
    fields.refuse("use_beam_search", allowed=(None, False))
    fields.refuse("length_penalty", allowed=(None, 1, 1.0), why="it applies to beam search")
    fields.refuse("spaces_between_special_tokens", allowed=(None, True))
    fields.refuse("return_tokens_as_token_ids", allowed=(None, False))
    fields.refuse("allowed_token_ids", why="use logit_bias")
    fields.refuse("bad_words", allowed=(None, []), why="use logit_bias")
    for field in ("logits_processors", "prompt_embeds", "request_id", "kv_transfer_params"):
        fields.refuse(field)


def _choices(fields: Fields, stream: bool) -> tuple[int, int]:
    n = fields.integer("n", 1, low=1, high=MAX_CHOICES)
    best_of = fields.integer("best_of", n, low=1, high=MAX_CHOICES)
    if best_of < n:
        raise fields.error("best_of", f"must be >= n={n}, got {best_of}")
    if stream and best_of > n:
        raise fields.error("best_of", "> n cannot stream: the best are known only at the end")
    return n, best_of


def _prompt(fields: Fields) -> str | tuple[int, ...]:
    prompt = fields.raw("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and not all(type(t) is int for t in prompt):
        raise fields.error(
            "prompt", f"is a batch of {len(prompt)} prompts; send one request per prompt"
        )
    raise fields.error("prompt", "must be a non-empty string or list of token ids")


def parse_template_kwargs(fields: Fields | None) -> dict[str, Any]:
    """``chat_template_kwargs``: extra template variables (not the request's own)."""
    if fields is None:
        return {}
    values = fields.everything()
    reserved = {"messages", "add_generation_prompt"} & set(values)
    if reserved:
        raise fields.error(sorted(reserved)[0], "is set by the request itself")
    return values


def _stop(fields: Fields) -> tuple[str, ...]:
    stop = fields.raw("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise fields.error("stop", "must be a non-empty string or a list of them")
    return tuple(stop)


def _truncate(fields: Fields) -> int | None:
    value = fields.optional_integer("truncate_prompt_tokens", low=-1)
    if value == 0:
        raise fields.error("truncate_prompt_tokens", "must be >= 1, or -1 for max_model_len")
    return value


def _num_logprobs(fields: Fields, name: str) -> int | None:
    return fields.optional_integer(name, low=0, high=MAX_LOGPROBS)


def _optional_bool(fields: Fields, name: str) -> bool | None:
    return fields.boolean(name, False) if fields.has(name) else fields.raw(name)
