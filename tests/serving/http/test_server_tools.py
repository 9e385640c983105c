"""Tool calls through the server with the official client: named and required calls
constrained by the grammar, auto calls read by the parser, streamed and whole, and the
tool turns of a follow-up conversation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from tool_samples import ASK, CLOCK, WEATHER, ScriptedExecutor

from hybridkv.serving.openai.chat_template import ChatTemplate
from hybridkv.testing import SamplingFakeExecutor

MODEL = "fake-model"


def client_of(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)


@pytest.fixture
def constrained(make_sampling_server: Any) -> Iterator[openai.OpenAI]:
    with client_of(make_sampling_server()) as client:
        yield client


def test_a_named_tool_choice_always_calls_it(constrained: openai.OpenAI) -> None:
    done = constrained.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER, CLOCK],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    assert call.id.startswith("call_")


def test_required_calls_one_of_the_tools_or_more(constrained: openai.OpenAI) -> None:
    for seed in range(3):
        done = constrained.chat.completions.create(
            model=MODEL,
            messages=ASK,  # type: ignore[arg-type]
            tools=[WEATHER, CLOCK],  # type: ignore[list-item]
            tool_choice="required",
            parallel_tool_calls=False,  # one call: random logits would add calls forever
            max_tokens=120,
            seed=seed,
        )
        calls = done.choices[0].message.tool_calls or []
        assert len(calls) == 1 and done.choices[0].finish_reason == "tool_calls"
        for call in calls:
            arguments = json.loads(call.function.arguments)
            assert set(arguments) == {"city" if call.function.name == "get_weather" else "zone"}


def test_a_streamed_call_comes_whole_in_the_last_chunk(constrained: openai.OpenAI) -> None:
    chunks = list(
        constrained.chat.completions.create(
            model=MODEL,
            messages=ASK,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=60,
            stream=True,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    last = [c for c in chunks if c.choices][-1].choices[0]
    assert last.finish_reason == "tool_calls"
    (call,) = last.delta.tool_calls or []
    assert call.index == 0 and call.function and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments or "")) == {"city"}


@pytest.fixture
def auto(hermes_server: Any) -> Iterator[openai.OpenAI]:
    with client_of(hermes_server) as client:
        yield client


def test_auto_reads_a_hermes_call_after_the_content(auto: openai.OpenAI) -> None:
    done = auto.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=200,
    )
    message = done.choices[0].message
    assert message.content == "Let me check. "
    (call,) = message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert done.choices[0].finish_reason == "tool_calls"


def test_auto_streams_the_content_and_never_the_markup(auto: openai.OpenAI) -> None:
    chunks = list(
        auto.chat.completions.create(
            model=MODEL,
            messages=ASK,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            max_tokens=200,
            stream=True,
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Let me check. "
    calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert [json.loads(c.function.arguments or "") for c in calls] == [{"city": "Paris"}]


def test_text_without_a_call_is_the_content(auto: openai.OpenAI) -> None:
    ScriptedExecutor.script = "It is sunny <tool_"  # a marker's beginning, never finished
    done = auto.chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=200,
    )
    assert done.choices[0].message.content == "It is sunny <tool_"
    assert not done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "stop"


def test_auto_needs_the_server_flags(constrained: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice") as info:
        constrained.chat.completions.create(
            model=MODEL,
            messages=ASK,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice="auto",
        )
    assert info.value.body["param"] == "tool_choice"  # type: ignore[index]


def test_tools_and_tool_turns_reach_the_template(make_server: Any) -> None:
    """The template sees the tools, an assistant turn's calls and the tool's answer:
    the prompt's byte count is that of the text it renders."""
    source = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<{{ c.function.name }}({{ c.function.arguments.city }})>"
        "{% endfor %}{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %};{% endfor %}"
    )
    server = make_server(
        executor_class=SamplingFakeExecutor,
        chat_template=ChatTemplate(source, is_builtin=False),
    )
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    with client_of(server) as client:
        done = client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice="none",
            max_tokens=2,
        )
    expected = "[get_weather]user:Weather in Paris?;assistant:<get_weather(Paris)>;tool:18C#call_1;"
    assert done.usage is not None and done.usage.prompt_tokens == len(expected.encode())
