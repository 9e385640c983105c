"""Log-probabilities laid out as OpenAI's legacy completions, OpenAI's chat and vLLM return them.

The engine reports one :class:`TokenLogprobs` per token (its logprob, its rank, the most
likely tokens at its position). Here tokens are named by their own text and the numbers
are laid out per API, for a whole response or one streamed chunk at a time::

    completions   {"tokens": ["w5", "w6"], "token_logprobs": [-0.69, -1.39],
                   "top_logprobs": [{"w5": -0.69, ...}, ...], "text_offset": [0, 2]}
    chat          {"content": [{"token": "w5", "logprob": -0.69, "bytes": [119, 53],
                                "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}
    vLLM prompt   [None, {"5": {"logprob": -0.69, "rank": 1, "decoded_token": "w5"}}, ...]

A request that asks for no logprobs gets no :class:`LogprobsStream`: nothing here runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tokenizers import Tokenizer

from hybridkv.errors import HybridKVError
from hybridkv.scheduler.outputs import RequestOutput, TokenLogprobs
from hybridkv.serving.openai.protocol import GenerationRequest

#: The floor OpenAI and vLLM report for a logprob of -inf, which JSON cannot carry.
LOGPROB_FLOOR = -9999.0

#: A token id and its logprobs (None for the first prompt token: nothing predicts it).
Entry = tuple[int, TokenLogprobs | None]


class LogprobsMismatchError(HybridKVError):
    """The engine reported logprobs for another number of tokens than it produced."""


class TokenTexts:
    """Each token's own text: the token decoded alone, special tokens kept, as vLLM does.

    So ``<eos>`` among the top tokens is named, not an empty string. Texts are cached:
    at most one entry per token of the vocabulary.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text


class LogprobsStream:
    """One request's logprobs: gathered from its outputs, taken per body or chunk.

    Attributes:
        prompt_logprobs: vLLM's ``prompt_logprobs`` field once the first output came, if
            the request asked for it; else None.

    Args:
        request: The parsed request (its logprob counts, echo, and chat or not).
        prompt_ids: The prompt's tokens.
        texts: Token texts.
    """

    def __init__(
        self, request: GenerationRequest, prompt_ids: Sequence[int], texts: TokenTexts
    ) -> None:
        self._request = request
        self._prompt_ids = prompt_ids
        self._texts = texts
        self._pending: list[Entry] = []
        self._offset = 0  # a completion's text_offset: the length of the tokens before
        self.prompt_logprobs: list[dict[str, Any] | None] | None = None

    @classmethod
    def for_request(
        cls, request: GenerationRequest, prompt_ids: Sequence[int], texts: TokenTexts
    ) -> LogprobsStream | None:
        """The stream of a request that asks for logprobs; None for one that does not."""
        if request.logprobs is None and request.prompt_logprobs is None:
            return None
        return cls(request, prompt_ids, texts)

    def push(self, out: RequestOutput) -> None:
        """Gather the logprobs of one engine output.

        Raises:
            LogprobsMismatchError: they do not match the output's tokens one to one.
        """
        request = self._request
        if out.prompt_logprobs is not None:
            prompt = list(_zip(self._prompt_ids, out.prompt_logprobs, "prompt"))
            if request.prompt_logprobs is not None:
                self.prompt_logprobs = self._vllm_prompt(prompt, request.prompt_logprobs)
            if request.echo and request.logprobs is not None:
                self._pending.extend(prompt)
        if request.logprobs is not None:
            self._pending.extend(_zip(out.new_token_ids, out.logprobs or (), "generated"))

    def take(self) -> dict[str, Any] | None:
        """The ``logprobs`` of the tokens pushed since the last take (None if not asked)."""
        num_top = self._request.logprobs
        if num_top is None:
            return None
        entries, self._pending = self._pending, []
        if self._request.is_chat:
            return {"content": [self._chat_token(entry, num_top) for _, entry in entries]}
        return self._completion(entries, num_top)

    def _completion(self, entries: Iterable[Entry], num_top: int) -> dict[str, Any]:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, entry in entries:
            text = self._texts(token_id)
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(_clamp(entry.logprob))
            # OpenAI's legacy rule: the top tokens and the chosen one, so up to k + 1.
            top = {text: _clamp(entry.logprob)}
            for top_id, logprob in entry.top[:num_top]:
                top.setdefault(self._texts(top_id), _clamp(logprob))
            top_logprobs.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def _chat_token(self, entry: TokenLogprobs | None, num_top: int) -> dict[str, Any]:
        assert entry is not None, "chat lists generated tokens only"
        top = [self._chat_top(token_id, logprob) for token_id, logprob in entry.top[:num_top]]
        return {**self._chat_top(entry.token_id, entry.logprob), "top_logprobs": top}

    def _chat_top(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self._texts(token_id)
        return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode())}

    def _vllm_prompt(self, entries: Iterable[Entry], num_top: int) -> list[dict[str, Any] | None]:
        out: list[dict[str, Any] | None] = []
        for _, entry in entries:
            if entry is None:
                out.append(None)
                continue
            # The prompt's token first, then the top ones (ranked 1..k), as vLLM does.
            ranked = [(entry.token_id, entry.logprob, entry.rank)]
            ranked += [(t, lp, i + 1) for i, (t, lp) in enumerate(entry.top[:num_top])]
            position: dict[str, Any] = {}
            for token_id, logprob, rank in ranked:
                position.setdefault(
                    str(token_id),
                    {
                        "logprob": _clamp(logprob),
                        "rank": rank,
                        "decoded_token": self._texts(token_id),
                    },
                )
            out.append(position)
        return out


def _zip(
    token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None], what: str
) -> Iterable[Entry]:
    if len(token_ids) != len(entries):
        raise LogprobsMismatchError(
            f"the engine reported logprobs for {len(entries)} {what} tokens, not {len(token_ids)}"
        )
    return zip(token_ids, entries, strict=True)


def _clamp(logprob: float) -> float:
    # Also maps NaN to the floor: the body must stay valid JSON whatever the model did.
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR
