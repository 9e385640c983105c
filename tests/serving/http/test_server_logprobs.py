"""Logprobs through the live server, checked against the fake's law and the OpenAI client.

The fake makes the token it samples (``a``) the most likely at each position, and gives
token ``t`` the logprob ``-(j + 1) ln 2`` and rank ``j + 1``, with ``j = (t - a) mod 64``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from hybridkv.scheduler.fake import reference_tokens
from hybridkv.serving.openai.chat_template import ChatTemplate

MODEL = "fake-model"
VOCAB = 64
LN2 = math.log(2)
PROMPT = "w2 w3 w4"
PROMPT_IDS = [2, 3, 4]
NO_EOS = {"ignore_eos": True}  # keep lengths fixed


def name(token_id: int) -> str:
    """A token's own text in the word tokenizer."""
    return {0: "[UNK]", 1: "<eos>"}.get(token_id, f"w{token_id}")


def law(context: Sequence[int], token_id: int, num_top: int) -> tuple[float, int, list[int]]:
    """The fake's logprob and rank of ``token_id`` after ``context``, and its top tokens."""
    top = reference_tokens(context, 1, VOCAB)[0]
    j = (token_id - top) % VOCAB
    return -(j + 1) * LN2, j + 1, [(top + i) % VOCAB for i in range(num_top)]


def top_dict(token_ids: list[int]) -> dict[str, float]:
    return {name(t): pytest.approx(-(i + 1) * LN2) for i, t in enumerate(token_ids)}


def post(server: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=10)


def completion_logprobs(
    client: Any, *, stream: bool, **fields: Any
) -> tuple[str, dict[str, list[Any]]]:
    """The text and the logprobs lists of a completion, joined over chunks if streamed."""
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, stream=stream, extra_body=NO_EOS, **fields
    )
    choices = [c.choices[0] for c in out] if stream else [out.choices[0]]
    lists: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for choice in choices:
        for key, values in lists.items():
            values.extend(getattr(choice.logprobs, key))
    return "".join(c.text for c in choices), lists


def test_completion_logprobs_follow_the_fake(client: Any) -> None:
    """Each generated token has logprob -ln 2 (rank 1) and its top 2 are a, a + 1."""
    _, lists = completion_logprobs(client, stream=False, logprobs=2)
    generated = reference_tokens(PROMPT_IDS, 5, VOCAB)
    assert lists["tokens"] == [name(t) for t in generated]
    assert lists["token_logprobs"] == pytest.approx([-LN2] * 5)
    assert lists["top_logprobs"] == [top_dict([t, (t + 1) % VOCAB]) for t in generated]
    lengths = [len(name(t)) for t in generated]
    assert lists["text_offset"] == [sum(lengths[:i]) for i in range(5)]


def test_echo_prepends_the_prompt_and_its_logprobs(client: Any) -> None:
    """With echo, the text and the lists begin with the prompt; its first token has None."""
    text, lists = completion_logprobs(client, stream=False, logprobs=1, echo=True)
    assert text.startswith(PROMPT)
    assert lists["tokens"][:3] == ["w2", "w3", "w4"]
    assert lists["token_logprobs"][0] is None and lists["top_logprobs"][0] is None
    for i in (1, 2):
        logprob, _, (top,) = law(PROMPT_IDS[:i], PROMPT_IDS[i], 1)
        assert lists["token_logprobs"][i] == pytest.approx(logprob)
        expected = {name(PROMPT_IDS[i]): pytest.approx(logprob), name(top): pytest.approx(-LN2)}
        assert lists["top_logprobs"][i] == expected
    assert len(lists["tokens"]) == 3 + 5


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_completion_logprobs_join_to_the_whole(client: Any, echo: bool) -> None:
    """Streamed chunks' text and logprobs, joined, equal the non-streamed response."""
    whole = completion_logprobs(client, stream=False, logprobs=3, echo=echo)
    assert completion_logprobs(client, stream=True, logprobs=3, echo=echo) == whole


CHAT = [{"role": "user", "content": "w5 w6"}]


def chat_prompt_ids(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(ChatTemplate.plain().render(CHAT)).ids


def chat_content(client: Any, *, stream: bool) -> list[Any]:
    """The logprobs content of a chat, joined over chunks if streamed."""
    out = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        stream=stream,
        extra_body=NO_EOS,
    )
    choices = [c.choices[0] for c in out if c.choices[0].logprobs] if stream else [out.choices[0]]
    return [t for c in choices for t in c.logprobs.content]


def test_chat_logprobs_follow_the_fake(client: Any, word_tokenizer: Tokenizer) -> None:
    """Chat content lists each token, its logprob, bytes and its top 3, most likely first."""
    content = chat_content(client, stream=False)
    generated = reference_tokens(chat_prompt_ids(word_tokenizer), 4, VOCAB)
    assert [(t.token, t.bytes) for t in content] == [
        (name(t), list(name(t).encode())) for t in generated
    ]
    assert [t.logprob for t in content] == pytest.approx([-LN2] * 4)
    for token, sampled in zip(content, generated, strict=True):
        tops = [(t.token, t.logprob) for t in token.top_logprobs]
        expected = [(name((sampled + i) % VOCAB), pytest.approx(-(i + 1) * LN2)) for i in range(3)]
        assert tops == expected


def test_streamed_chat_logprobs_join_to_the_whole(client: Any) -> None:
    """Streamed chat chunks' logprobs, joined, equal the non-streamed content."""
    assert chat_content(client, stream=True) == chat_content(client, stream=False)


def test_logprobs_are_off_by_default(client: Any) -> None:
    """A request that asks for none gets logprobs null."""
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert out.choices[0].logprobs is None


def test_vllm_prompt_logprobs_in_the_completion_choice(server: Any) -> None:
    """vLLM's prompt_logprobs: None first, then each prompt token and its top 2 by id."""
    body = post(
        server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2}
    )
    positions = body.json()["choices"][0]["prompt_logprobs"]
    assert positions[0] is None and len(positions) == 3
    for i in (1, 2):
        token_id = PROMPT_IDS[i]
        logprob, rank, tops = law(PROMPT_IDS[:i], token_id, 2)
        expected = {
            str(t): {
                "logprob": pytest.approx(-(r + 1) * LN2),
                "rank": r + 1,
                "decoded_token": name(t),
            }
            for r, t in enumerate(tops)
        }
        expected.setdefault(
            str(token_id),
            {"logprob": pytest.approx(logprob), "rank": rank, "decoded_token": name(token_id)},
        )
        assert positions[i] == expected


def test_vllm_prompt_logprobs_at_the_top_of_a_chat(server: Any, word_tokenizer: Tokenizer) -> None:
    """A chat response carries prompt_logprobs at its top, one entry per prompt token."""
    body = {"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0}
    response = post(server, "/v1/chat/completions", body).json()
    prompt_ids = chat_prompt_ids(word_tokenizer)
    positions = response["prompt_logprobs"]
    assert len(positions) == response["usage"]["prompt_tokens"] == len(prompt_ids)
    logprob, rank, _ = law(prompt_ids[:1], prompt_ids[1], 0)
    entry = {"logprob": pytest.approx(logprob), "rank": rank, "decoded_token": name(prompt_ids[1])}
    assert positions[1] == {str(prompt_ids[1]): entry}
    assert response["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/completions", "logprobs", -1),
        ("/v1/completions", "logprobs", 21),
        ("/v1/completions", "logprobs", True),
        ("/v1/completions", "logprobs", "2"),
        ("/v1/completions", "prompt_logprobs", 2.0),
        ("/v1/chat/completions", "top_logprobs", 21),
        ("/v1/chat/completions", "logprobs", 1),
    ],
)
def test_bad_logprob_values_are_refused(server: Any, path: str, field: str, value: object) -> None:
    """A bad logprob field is a 400 naming it, and the server keeps serving."""
    if "chat" in path:
        body = {"messages": [{"role": "user", "content": "w5"}], "max_tokens": 2}
        asks: dict[str, Any] = {"logprobs": True}
    else:
        body, asks = {"prompt": PROMPT, "max_tokens": 2}, {}
    refused = post(server, path, {**body, **asks, field: value})
    error = refused.json()["error"]
    assert (refused.status_code, error["type"], error["param"]) == (
        400,
        "invalid_request_error",
        field,
    )
    assert post(server, path, body).status_code == 200


def test_chat_top_logprobs_without_logprobs_is_refused(server: Any) -> None:
    """Chat top_logprobs without logprobs=true is a 400, as OpenAI answers."""
    body = {"messages": [{"role": "user", "content": "w5"}], "top_logprobs": 2}
    refused = post(server, "/v1/chat/completions", body)
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "top_logprobs")


def test_streamed_prompt_logprobs_are_refused(server: Any) -> None:
    """prompt_logprobs with stream=true is a 400, as vLLM answers."""
    body = {"prompt": PROMPT, "stream": True, "prompt_logprobs": 1}
    refused = post(server, "/v1/completions", body)
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "prompt_logprobs")
