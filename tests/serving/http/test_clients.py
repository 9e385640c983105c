"""The clients vLLM users run, against the server: instructor and LangChain, each in the
modes they default to (function calling) and the JSON-schema ones, LangChain over the
Responses API, and litellm's ``openai/`` provider (tool calls auto, required, named and
streamed, JSON schema, the Responses API, async). The sampling fake writes random text,
so whatever parses here parses because the grammar made it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import anyio
import openai
import pytest
from pydantic import BaseModel, Field
from tool_samples import ASK, CLOCK, WEATHER

MODEL = "fake-model"


class City(BaseModel):
    name: str = Field(max_length=10)
    population: int


@pytest.fixture
def url(make_sampling_server: Any) -> Iterator[str]:
    server = make_sampling_server()
    yield f"{server.url}/v1"
    server.wait_until_free()


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_gets_its_model(url: str, mode: str) -> None:
    import instructor

    client = instructor.from_openai(
        openai.OpenAI(base_url=url, api_key="-", max_retries=0), mode=getattr(instructor.Mode, mode)
    )
    for seed in range(3):
        city = client.chat.completions.create(
            model=MODEL,
            response_model=City,
            messages=[{"role": "user", "content": "A city, please"}],
            max_tokens=80,
            max_retries=0,
            seed=seed,
        )
        assert isinstance(city, City) and len(city.name) <= 10


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output(url: str, method: str) -> None:
    from langchain_openai import ChatOpenAI

    # Seeded: the random text is the same each run (any whitespace is allowed, so the
    # JSON of the json_schema method may be long).
    chat = ChatOpenAI(base_url=url, api_key="-", model=MODEL, max_tokens=200, max_retries=0, seed=0)
    city = chat.with_structured_output(City, method=method).invoke("A city, please")  # type: ignore[arg-type]
    assert isinstance(city, City)


def test_langchain_over_the_responses_api(url: str) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        base_url=url, api_key="-", model=MODEL, max_tokens=8, max_retries=0, use_responses_api=True
    )
    reply = chat.invoke("Hello")
    assert reply.text and reply.response_metadata.get("id", "").startswith("resp_")


@pytest.fixture
def litellm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    # The bundled model map: without this litellm fetches one at import.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    # litellm's blocking calls dispatch their service hooks on the main thread's event
    # loop, making one if there is none and never closing it: give them one, and close it.
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield litellm
    asyncio.set_event_loop(None)
    loop.close()


def litellm_args(url: str) -> dict[str, str]:
    return {"model": f"openai/{MODEL}", "api_base": url, "api_key": "-"}


def test_litellm_named_and_required_tool_calls(litellm: Any, url: str) -> None:
    named = litellm.completion(
        messages=ASK,
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        **litellm_args(url),
    )
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and named.choices[0].finish_reason == "tool_calls"
    assert set(json.loads(call.function.arguments)) == {"city"}

    chunks = list(
        litellm.completion(
            messages=ASK,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=120,
            seed=1,
            stream=True,
            **litellm_args(url),
        )
    )
    built = litellm.stream_chunk_builder(chunks, messages=ASK)
    (call,) = built.choices[0].message.tool_calls
    expected = {"get_weather": {"city"}, "get_time": {"zone"}}[call.function.name]
    assert set(json.loads(call.function.arguments)) == expected


def test_litellm_reads_an_auto_call(litellm: Any, hermes_server: Any) -> None:
    done = litellm.completion(
        messages=ASK, tools=[WEATHER], max_tokens=200, **litellm_args(f"{hermes_server.url}/v1")
    )
    message = done.choices[0].message
    assert message.content == "Let me check. "
    (call,) = message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_litellm_json_schema_and_async(litellm: Any, url: str) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    async def ask() -> Any:
        return await litellm.acompletion(
            messages=[{"role": "user", "content": "A number"}],
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
            max_tokens=60,
            seed=0,
            **litellm_args(url),
        )

    done = anyio.run(ask)
    assert set(json.loads(done.choices[0].message.content)) == {"n"}
    assert done.usage.completion_tokens >= 1 and done.usage.prompt_tokens >= 1


def test_litellm_over_the_responses_api(litellm: Any, url: str) -> None:
    first = litellm.responses(input="Hello", max_output_tokens=8, **litellm_args(url))
    second = litellm.responses(
        input="Again", previous_response_id=first.id, max_output_tokens=8, **litellm_args(url)
    )
    assert first.output[0].content[0].text
    assert second.status in {"completed", "incomplete"}  # random text may end before 8
    assert second.usage.input_tokens > first.usage.input_tokens  # the first turn came along
