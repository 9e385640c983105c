"""The clients vLLM users run, against the server: instructor and LangChain, each in the
modes they default to (function calling) and the JSON-schema ones, and LangChain over
the Responses API. The sampling fake writes random text, so whatever parses here parses
because the grammar made it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field

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
