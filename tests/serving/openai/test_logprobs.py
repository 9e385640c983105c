"""Logprobs laid out per API from hand-made engine outputs: completions, chat, vLLM's
prompt_logprobs, across streamed chunks."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import pytest
from tokenizers import Tokenizer

from hybridkv.scheduler import RequestOutput, TokenLogprobs
from hybridkv.serving.openai.logprobs import LogprobsMismatchError, LogprobsStream, TokenTexts
from hybridkv.serving.openai.protocol import parse_chat, parse_completion

LN2 = math.log(2)
PROMPT = (5, 6, 7)


def lp(token_id: int, rank: int, top: Sequence[int] = ()) -> TokenLogprobs:
    """Logprobs where rank r has logprob -r ln 2 (the test fake's law)."""
    return TokenLogprobs(
        token_id=token_id,
        logprob=-rank * LN2,
        rank=rank,
        top=tuple((t, -(i + 1) * LN2) for i, t in enumerate(top)),
    )


def output(
    new: Sequence[TokenLogprobs],
    prompt: Sequence[TokenLogprobs | None] | None = None,
    num_output_tokens: int | None = None,
) -> RequestOutput:
    ids = tuple(e.token_id for e in new)
    return RequestOutput(
        request_id="r",
        new_token_ids=ids,
        finish_reason=None,
        num_prompt_tokens=len(PROMPT),
        num_output_tokens=num_output_tokens or len(ids),
        num_cached_tokens=0,
        num_preemptions=0,
        logprobs=tuple(new),
        prompt_logprobs=None if prompt is None else tuple(prompt),
        sequence=[*PROMPT, *ids],
    )


def stream(word_tokenizer: Tokenizer, **fields: object) -> LogprobsStream:
    request = parse_completion({"model": "m", "prompt": "w5 w6 w7", **fields})
    made = LogprobsStream.for_request(request, PROMPT, TokenTexts(word_tokenizer))
    assert made is not None
    return made


def test_no_stream_for_a_request_without_logprobs(word_tokenizer: Tokenizer) -> None:
    """A request that asks for no logprobs gets no stream, so no work is done for it."""
    request = parse_completion({"model": "m", "prompt": "w5", "echo": True})
    assert LogprobsStream.for_request(request, PROMPT, TokenTexts(word_tokenizer)) is None


def test_completion_lists_tokens_logprobs_tops_and_offsets(word_tokenizer: Tokenizer) -> None:
    """Completion logprobs name each token by its text, with top k and running offsets."""
    logprobs = stream(word_tokenizer, logprobs=2)
    logprobs.push(output([lp(10, 1, [10, 11]), lp(12, 1, [12, 13])]))
    assert logprobs.take() == {
        "tokens": ["w10", "w12"],
        "token_logprobs": [-LN2, -LN2],
        "top_logprobs": [{"w10": -LN2, "w11": -2 * LN2}, {"w12": -LN2, "w13": -2 * LN2}],
        "text_offset": [0, 3],
    }


def test_completion_top_includes_the_sampled_token(word_tokenizer: Tokenizer) -> None:
    """A sampled token outside the top k is added to its top_logprobs (k + 1 entries)."""
    logprobs = stream(word_tokenizer, logprobs=1)
    logprobs.push(output([lp(9, 4, [6])]))
    body = logprobs.take()
    assert body is not None
    assert body["top_logprobs"] == [{"w9": -4 * LN2, "w6": -LN2}]


def test_echo_puts_the_prompt_first(word_tokenizer: Tokenizer) -> None:
    """With echo, prompt tokens lead the lists; the first has no logprob and no top."""
    logprobs = stream(word_tokenizer, logprobs=1, echo=True)
    prompt = [None, lp(6, 2, [5, 4]), lp(7, 1, [7, 8])]  # tops longer than asked: cut
    logprobs.push(output([lp(20, 1, [20])], prompt=prompt))
    body = logprobs.take()
    assert body is not None
    assert body["tokens"] == ["w5", "w6", "w7", "w20"]
    assert body["token_logprobs"] == [None, -2 * LN2, -LN2, -LN2]
    assert body["top_logprobs"] == [None, {"w6": -2 * LN2, "w5": -LN2}, {"w7": -LN2}, {"w20": -LN2}]
    assert body["text_offset"] == [0, 2, 4, 6]


def test_chunks_carry_their_own_tokens_with_running_offsets(word_tokenizer: Tokenizer) -> None:
    """Each take lists the tokens pushed since the last, offsets counting on."""
    logprobs = stream(word_tokenizer, logprobs=0)
    logprobs.push(output([lp(10, 1)]))
    first = logprobs.take()
    logprobs.push(output([lp(11, 1), lp(2, 1)], num_output_tokens=3))
    second = logprobs.take()
    assert first is not None and second is not None
    assert (first["tokens"], first["text_offset"]) == (["w10"], [0])
    assert (second["tokens"], second["text_offset"]) == (["w11", "w2"], [3, 6])
    assert logprobs.take() == {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }


def test_chat_content_has_bytes_and_top_lists(word_tokenizer: Tokenizer) -> None:
    """Chat logprobs are content entries with UTF-8 bytes and a top_logprobs list."""
    request = parse_chat(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 2,
        }
    )
    logprobs = LogprobsStream.for_request(request, PROMPT, TokenTexts(word_tokenizer))
    assert logprobs is not None
    logprobs.push(output([lp(1, 3, [63, 0])]))
    token = {"token": "<eos>", "logprob": -3 * LN2, "bytes": list(b"<eos>")}
    tops = [
        {"token": "w63", "logprob": -LN2, "bytes": list(b"w63")},
        {"token": "[UNK]", "logprob": -2 * LN2, "bytes": list(b"[UNK]")},
    ]
    assert logprobs.take() == {"content": [{**token, "top_logprobs": tops}]}


def test_vllm_prompt_logprobs_by_token_id(word_tokenizer: Tokenizer) -> None:
    """vLLM's prompt_logprobs: None first, then the token and the top ones by id string."""
    logprobs = stream(word_tokenizer, prompt_logprobs=1)
    logprobs.push(output([lp(20, 1)], prompt=[None, lp(6, 3, [4]), lp(7, 1, [7])]))
    assert logprobs.take() is None  # logprobs itself was not asked
    assert logprobs.prompt_logprobs == [
        None,
        {
            "6": {"logprob": -3 * LN2, "rank": 3, "decoded_token": "w6"},
            "4": {"logprob": -LN2, "rank": 1, "decoded_token": "w4"},
        },
        {"7": {"logprob": -LN2, "rank": 1, "decoded_token": "w7"}},
    ]


def test_minus_infinity_becomes_the_floor(word_tokenizer: Tokenizer) -> None:
    """A logprob of -inf (or NaN) is reported as -9999.0, which JSON can carry."""
    logprobs = stream(word_tokenizer, logprobs=1)
    entry = TokenLogprobs(token_id=9, logprob=-math.inf, rank=64, top=((3, math.nan),))
    logprobs.push(output([entry]))
    body = logprobs.take()
    assert body is not None
    assert (body["token_logprobs"], body["top_logprobs"]) == (
        [-9999.0],
        [{"w9": -9999.0, "w3": -9999.0}],
    )


def test_logprobs_for_other_tokens_are_an_error(word_tokenizer: Tokenizer) -> None:
    """Logprobs that do not match the output's tokens one to one raise, naming the counts."""
    logprobs = stream(word_tokenizer, logprobs=0)
    two = output([lp(10, 1), lp(11, 1)])
    with pytest.raises(LogprobsMismatchError, match="for 1 generated tokens, not 2"):
        logprobs.push(attrs.evolve(two, logprobs=(lp(10, 1),)))
