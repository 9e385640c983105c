"""A request's prompt to token ids, off the event loop, refused early when it cannot fit.

::

    messages --render (thread, sandboxed)--> text --tokenize (thread)--> ids --truncate
    prompt   ------------------------------> text --^
    token ids -------------------------------------------------------> ids --^

Before any tokenizing, a cheap size check: no token is longer than the longest string
in the vocabulary (``max_token_chars``), so a text longer than ``max_model_len *
max_token_chars`` characters can never fit and is refused at once (a 3 MiB prompt used
to hold the loop for 4 s before its refusal). The check assumes the tokenizer keeps
every character, as byte-level BPE and SentencePiece tokenizers do. Rendering always
runs in a worker thread (the template is checkpoint code); tokenizing does for texts over
a few KiB, through ``encode_batch``, which releases the GIL while it works. A limiter
bounds the threads all requests may use at once.
"""

from __future__ import annotations

import anyio
from tokenizers import Tokenizer

from hybridkv.serving.openai.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    ChatTemplateTooLongError,
    RenderLimits,
)
from hybridkv.serving.openai.errors import APIError
from hybridkv.serving.openai.protocol import GenerationRequest

#: Texts up to this many characters are tokenized on the loop (cheaper than a thread hop).
_INLINE_CHARS = 4096


class Prompter:
    """Turns requests' prompts into token ids for one tokenizer and chat template.

    Args:
        tokenizer: The model's tokenizer (its vocabulary is read once here).
        chat_template: Renders chat messages.
        max_model_len: Most tokens of prompt and output together.
        limiter: Bounds the worker threads of rendering and tokenizing.
        template_timeout_s: Seconds one rendering may take.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate,
        *,
        max_model_len: int,
        limiter: anyio.CapacityLimiter,
        template_timeout_s: float = 5.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_model_len = max_model_len
        self.limiter = limiter
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_chars = max_model_len * self.max_token_chars
        self.render_limits = RenderLimits(timeout_s=template_timeout_s, max_chars=self.max_chars)

    async def token_ids(self, request: GenerationRequest) -> list[int]:
        """The prompt's tokens, truncated as the request asks.

        Raises:
            APIError: the prompt cannot fit (context_length_exceeded), the template
                failed, or ``truncate_prompt_tokens`` exceeds the context.
        """
        keep = self._kept_tokens(request)
        if request.messages is not None:
            text = await self.render(request)
            # A checkpoint's template writes the special tokens itself (BOS included).
            add_special = request.add_special_tokens
            if add_special is None:
                add_special = self.chat_template.is_builtin
            ids = await self.encode(text, add_special, param="messages", check_fits=not keep)
        elif isinstance(request.prompt, str):
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
            ids = await self.encode(
                request.prompt, add_special, param="prompt", check_fits=not keep
            )
        else:
            assert request.prompt is not None
            ids = list(request.prompt)
        return ids[-keep:] if keep else ids

    async def render(self, request: GenerationRequest) -> str:
        """The chat request's prompt text (a 400 for any template failure)."""
        assert request.messages is not None
        template = self.chat_template

        variables = dict(request.template_kwargs or {})
        if request.tools is not None:  # Hugging Face templates read them beside messages
            variables["tools"] = [dict(tool) for tool in request.tools.tools]

        def render() -> str:
            return template.render(
                request.messages or (),
                add_generation_prompt=request.add_generation_prompt,
                variables=variables,
                limits=self.render_limits,
            )

        try:
            return await anyio.to_thread.run_sync(render, limiter=self.limiter)
        except ChatTemplateTooLongError as exc:
            raise self._too_long(f"{exc}", "messages") from None
        except ChatTemplateError as exc:
            raise APIError(str(exc), param="messages") from None

    async def encode(
        self, text: str, add_special_tokens: bool, *, param: str, check_fits: bool = True
    ) -> list[int]:
        """``text``'s tokens; with ``check_fits``, refused at once if it is too long to
        ever fit in the context (not for a prompt that will be truncated)."""
        if check_fits and len(text) > self.max_chars:
            raise self._too_long(
                f"the prompt has {len(text)} characters; this model's context of "
                f"{self.max_model_len} tokens holds at most {self.max_chars} "
                f"(no token is longer than {self.max_token_chars} characters)",
                param,
            )
        if len(text) <= _INLINE_CHARS:
            return self._encode(text, add_special_tokens)
        return await anyio.to_thread.run_sync(
            self._encode, text, add_special_tokens, limiter=self.limiter
        )

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch releases the GIL while it runs; encode holds it throughout.
        (encoding,) = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def _kept_tokens(self, request: GenerationRequest) -> int | None:
        keep = request.truncate_prompt_tokens
        if keep == -1:
            return self.max_model_len
        if keep is not None and keep > self.max_model_len:
            raise APIError(
                f"'truncate_prompt_tokens'={keep} exceeds this model's context of "
                f"{self.max_model_len} tokens",
                param="truncate_prompt_tokens",
            )
        return keep

    def _too_long(self, message: str, param: str) -> APIError:
        return APIError(message, param=param, code="context_length_exceeded")
