"""``/v1/responses`` with the official client: text in and out, instructions, streamed
events, conversations continued by ``previous_response_id``, and function tools."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

MODEL = "fake-model"


@pytest.fixture
def client(server: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as c:
        yield c


def test_text_in_text_out(client: openai.OpenAI, server: Any) -> None:
    done = client.responses.create(
        model=MODEL, input="w2 w3 w4", instructions="w9", max_output_tokens=5
    )
    assert done.object == "response" and done.id.startswith("resp_")
    assert done.output_text and done.output[0].type == "message"
    assert done.usage is not None and done.usage.output_tokens <= 5
    assert done.status in ("completed", "incomplete")
    server.wait_until_free()


def test_a_conversation_continues_from_the_previous_response(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="w2 w3", max_output_tokens=4)
    second = client.responses.create(
        model=MODEL, input="w5", previous_response_id=first.id, max_output_tokens=4
    )
    assert first.usage is not None and second.usage is not None
    # The second prompt holds the first exchange: more input tokens, the first's cached.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 1
    gone = client.responses.create(model=MODEL, input="w2", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError, match="is not stored"):
        client.responses.create(model=MODEL, input="w3", previous_response_id=gone.id)


def test_streamed_events_carry_the_text_and_end_completed(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": [{"type": "input_text", "text": "w2 w3"}]}],
            max_output_tokens=6,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = [e for e in events if e.type == "response.output_text.done"]
    assert deltas and done and done[0].text == deltas
    final = events[-1].response
    assert final.output_text == deltas and final.usage is not None
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_function_tool_is_called_as_an_output_item(make_sampling_server: Any) -> None:
    server = make_sampling_server()
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
        },
    }
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as c:
        done = c.responses.create(
            model=MODEL,
            input="weather?",
            tools=[tool],  # type: ignore[list-item]
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=60,
        )
        (call,) = [item for item in done.output if item.type == "function_call"]
        assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
        events = list(
            c.responses.create(
                model=MODEL,
                input="weather?",
                tools=[tool],  # type: ignore[list-item]
                tool_choice={"type": "function", "name": "get_weather"},
                max_output_tokens=60,
                stream=True,
            )
        )
        streamed = [e.item for e in events if e.type == "response.output_item.done"]
        assert [item.type for item in streamed] == ["function_call"]
        assert set(json.loads(streamed[0].arguments)) == {"city"}
        answered = c.responses.create(
            model=MODEL,
            previous_response_id=done.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18C"}],
            max_output_tokens=4,
        )
    assert answered.status in ("completed", "incomplete")


def test_unknown_and_malformed_fields(client: openai.OpenAI, server: Any) -> None:
    import httpx

    reply = httpx.post(
        f"{server.url}/v1/responses",
        json={"model": MODEL, "input": "w2", "max_output_tokens": 2, "colour": 1},
        timeout=30,
    )
    assert reply.status_code == 200  # ignored, named in a warning
    bad = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": 3}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
