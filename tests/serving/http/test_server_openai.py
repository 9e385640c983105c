"""The HTTP server against the official OpenAI client: completions and chat, whole and
streamed, concurrent clients, stop strings, models and health."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from hybridkv.scheduler.fake import reference_tokens
from hybridkv.serving.openai.chat_template import ChatTemplate

MODEL = "fake-model"
NO_EOS = {"ignore_eos": True}  # the fake may sample <eos>; keep lengths fixed


Expected = Callable[..., str]


@pytest.fixture
def expected_text(word_tokenizer: Tokenizer) -> Expected:
    """What the fake executor generates after a prompt, decoded."""

    def text_after(prompt: str, num_tokens: int, *, chat: bool = False) -> str:
        if chat:
            prompt = ChatTemplate.plain().render([{"role": "user", "content": prompt}])
        ids = word_tokenizer.encode(prompt).ids
        return word_tokenizer.decode(reference_tokens(ids, num_tokens, 64))

    return text_after


def test_completion_returns_the_engine_tokens_as_text(client: Any, expected_text: Expected) -> None:
    """A non-streamed completion is the decoded tokens the engine generated."""
    out = client.completions.create(model=MODEL, prompt="w2 w3 w4", max_tokens=6, extra_body=NO_EOS)
    assert out.choices[0].text == expected_text("w2 w3 w4", 6)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 6)


def test_streamed_completion_joins_to_the_same_text(client: Any, expected_text: Expected) -> None:
    """Streamed deltas join to the non-streamed text; the usage chunk comes last."""
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="w2 w3 w4",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected_text("w2 w3 w4", 6)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6


def test_chat_completion_renders_the_chat_template(client: Any, expected_text: Expected) -> None:
    """A chat request generates after the templated conversation."""
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "w5 w6"}],
        max_tokens=5,
        extra_body=NO_EOS,
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected_text("w5 w6", 5, chat=True)


def test_streamed_chat_sends_the_role_then_the_content(
    client: Any, expected_text: Expected
) -> None:
    """A streamed chat opens with the assistant role and its deltas join to the text."""
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "w5 w6"}],
            max_tokens=5,
            stream=True,
            extra_body=NO_EOS,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == expected_text("w5 w6", 5, chat=True)


def test_concurrent_clients_each_get_their_own_text(client: Any, expected_text: Expected) -> None:
    """Eight clients at once each get the text of their own prompt."""
    prompts = [f"w{i} w{i + 1} w{i + 2}" for i in range(2, 10)]
    results: dict[str, str] = {}

    def ask(prompt: str) -> None:
        stream = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, stream=True, extra_body=NO_EOS
        )
        results[prompt] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == {p: expected_text(p, 12) for p in prompts}


def test_stop_string_ends_the_completion(client: Any, expected_text: Expected) -> None:
    """A stop string cuts the text before it and finishes with reason stop."""
    full = expected_text("w2 w3 w4", 12)
    stop = full.split()[3]
    out = client.completions.create(
        model=MODEL, prompt="w2 w3 w4", max_tokens=12, stop=[stop], extra_body=NO_EOS
    )
    assert out.choices[0].text == full[: full.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_cached_prompt_tokens_are_reported(client: Any) -> None:
    """A repeated long prompt reports the tokens served from the prefix cache."""
    prompt = " ".join(f"w{2 + i % 60}" for i in range(40))
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_models_lists_the_served_model(client: Any) -> None:
    """/v1/models lists the one model the server serves."""
    assert [m.id for m in client.models.list()] == [MODEL]


def test_health_is_ok_while_the_engine_runs(server: Any) -> None:
    """/health answers 200 while the engine runs."""
    response = httpx.get(f"{server.url}/health", timeout=10)
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


def test_requests_leave_no_pages_behind(client: Any, server: Any) -> None:
    """After requests finish, every page is free again."""
    client.completions.create(model=MODEL, prompt="w2 w3 w4 w5 w6", max_tokens=9)
    stats = server.wait_until_free()
    assert stats.num_free_blocks == stats.num_blocks - 1
