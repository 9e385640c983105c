"""An Engine held in an async fixture: pytest-asyncio sets a fixture up in one task and
tears it down in another, which anyio's task groups refuse; the engine's loop runs in a
host task of its own on asyncio, so both plugins work."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from hybridkv.policies import FullAttention
from hybridkv.scheduler import Engine, EngineConfig, FakeExecutor, SamplingParams


def make_engine() -> Engine:
    config = EngineConfig(
        policies=[FullAttention()], num_blocks=32, block_size=4, max_model_len=64, vocab_size=50
    )
    return Engine(config, FakeExecutor.for_config(config))


@pytest_asyncio.fixture
async def asyncio_engine() -> AsyncIterator[Engine]:
    async with make_engine() as engine:
        yield engine


@pytest.fixture
async def anyio_engine() -> AsyncIterator[Engine]:
    async with make_engine() as engine:
        yield engine


async def generate(engine: Engine) -> list[int]:
    tokens: list[int] = []
    async with engine.generate([1, 2, 3], SamplingParams(max_tokens=5)) as stream:
        async for out in stream:
            tokens.extend(out.new_token_ids)
    return tokens


@pytest.mark.asyncio
async def test_an_engine_in_a_pytest_asyncio_fixture_serves_and_stops(
    asyncio_engine: Engine,
) -> None:
    assert len(await generate(asyncio_engine)) == 5
    assert asyncio_engine.is_running  # the fixture's teardown stops it, in another task


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_engine_in_an_anyio_fixture_serves_and_stops(anyio_engine: Engine) -> None:
    assert len(await generate(anyio_engine)) == 5
