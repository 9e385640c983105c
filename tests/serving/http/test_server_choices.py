"""n and best_of with the official client: every choice, streamed or whole, its own
text; copies share the prompt's pages; stop-token text and special tokens as vLLM."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from hybridkv.scheduler.fake import reference_tokens

MODEL = "fake-model"
NO_EOS = {"ignore_eos": True}
LONG_PROMPT = " ".join(f"w{2 + i % 60}" for i in range(40))


def metric(server: Any, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    match = re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_n_returns_n_choices_with_summed_usage(client: Any) -> None:
    """n=3 gives choices 0..2; usage counts the prompt once and every choice's tokens."""
    out = client.completions.create(
        model=MODEL, prompt="w2 w3", max_tokens=5, n=3, extra_body=NO_EOS
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (2, 15)


def test_copies_share_the_prompt_pages(server: Any, client: Any) -> None:
    """The copies of an n=4 request hit the prefix cache on the prompt's full pages."""
    client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2, n=4, extra_body=NO_EOS)
    full_pages = 40 // 4 * 4  # block size 4: the last prompt token is always computed
    assert metric(server, "hybridkv_cached_prompt_tokens_total") >= 3 * (full_pages - 4)
    server.wait_until_free()


def test_streamed_choices_join_to_the_whole_ones(client: Any) -> None:
    """Streaming n=2 chat: each index's deltas join to that choice's whole text."""
    messages = [{"role": "user", "content": "w4 w5"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, n=2, extra_body=NO_EOS
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
    )
    texts: dict[int, str] = defaultdict(str)
    reasons = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert dict(texts) == {c.index: c.message.content for c in whole.choices}
    assert reasons == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 12


def test_best_of_returns_the_n_most_likely(client: Any) -> None:
    """best_of=3, n=1: one choice, the copies' tokens are counted for the one returned."""
    out = client.completions.create(
        model=MODEL, prompt="w2 w3", max_tokens=4, n=1, best_of=3, extra_body=NO_EOS
    )
    assert [c.index for c in out.choices] == [0]
    assert out.usage.completion_tokens == 4
    assert out.choices[0].logprobs is None  # ranked with logprobs nobody asked to see


def test_best_of_cannot_stream(client: Any) -> None:
    """best_of > n with stream=true is a 400 naming best_of, as OpenAI answers."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="w2", n=1, best_of=2, stream=True)
    assert info.value.body["param"] == "best_of"  # type: ignore[index]


def test_best_of_below_n_is_refused(client: Any) -> None:
    """best_of < n is a 400."""
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="w2", n=3, best_of=2)


def test_echo_leads_every_choice(client: Any) -> None:
    """With echo and n=2 each choice's text starts with the prompt."""
    out = client.completions.create(
        model=MODEL, prompt="w2 w3", max_tokens=2, n=2, echo=True, extra_body=NO_EOS
    )
    assert all(c.text.startswith("w2 w3") for c in out.choices)


def test_too_many_copies_for_the_queue_are_refused_whole(make_server: Any) -> None:
    """When not all copies can queue, none runs: 503, and no page stays held."""
    server = make_server(max_waiting=2, max_num_seqs=1)
    body = {"model": MODEL, "prompt": "w2", "max_tokens": 2, "n": 5}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 503
    server.wait_until_free()


# -- stop tokens and special tokens ----------------------------------------------------


def test_stop_token_text_is_left_out_unless_asked(client: Any, word_tokenizer: Tokenizer) -> None:
    """A stop token ends the text without its own text, unless include_stop_str_in_output."""
    prompt = word_tokenizer.encode("w2 w3").ids
    tokens = reference_tokens(prompt, 6, 64)
    stop = tokens[3]
    cut = tokens[: tokens.index(stop)]
    fields = {"stop_token_ids": [stop], **NO_EOS}
    out = client.completions.create(model=MODEL, prompt="w2 w3", max_tokens=6, extra_body=fields)
    assert out.choices[0].text == word_tokenizer.decode(cut)
    assert out.choices[0].finish_reason == "stop"
    kept = client.completions.create(
        model=MODEL,
        prompt="w2 w3",
        max_tokens=6,
        extra_body={**fields, "include_stop_str_in_output": True},
    )
    assert kept.choices[0].text == word_tokenizer.decode([*cut, stop])


def test_stop_string_is_kept_when_asked(client: Any, word_tokenizer: Tokenizer) -> None:
    """include_stop_str_in_output keeps the stop string that ended the text."""
    prompt = word_tokenizer.encode("w2 w3").ids
    words = word_tokenizer.decode(reference_tokens(prompt, 6, 64)).split()
    out = client.completions.create(
        model=MODEL,
        prompt="w2 w3",
        max_tokens=6,
        stop=[words[2]],
        extra_body={"include_stop_str_in_output": True, **NO_EOS},
    )
    assert out.choices[0].text.endswith(words[2])


def test_special_tokens_are_shown_when_asked(make_server: Any, word_tokenizer: Tokenizer) -> None:
    """skip_special_tokens=false keeps <eos> in a text generated past it."""
    eos_prompt = next(
        f"w2 w{i}" for i in range(3, 63) if 1 in reference_tokens([2, i], 8, 64)
    )  # a prompt after which the fake samples <eos> (id 1)
    server = make_server()
    body = {"model": MODEL, "prompt": eos_prompt, "max_tokens": 8, "ignore_eos": True}
    hidden = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    shown = httpx.post(
        f"{server.url}/v1/completions", json={**body, "skip_special_tokens": False}, timeout=30
    ).json()
    assert "<eos>" in shown["choices"][0]["text"]
    assert "<eos>" not in hidden["choices"][0]["text"]
