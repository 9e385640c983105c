"""hybridkv.testing's helpers as a user's suite meets them: servers on both loops, the
leak checks, the tiny checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import httpx
import openai
import pytest

from hybridkv.policies import FullAttention
from hybridkv.scheduler import Engine, FakeExecutor, SamplingParams
from hybridkv.serving.http.app import build_app
from hybridkv.serving.http.hypercorn_server import serve_hypercorn
from hybridkv.serving.http.uvicorn_server import (
    ServeBackendError,
    bound_port,
    open_socket,
    serve_http,
)
from hybridkv.testing import (
    LeakError,
    LiveServer,
    check_no_leaks,
    default_config,
    live_server,
    wait_until_free,
    word_tokenizer,
)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_live_server_answers_the_official_client_on_both_loops(
    hybridkv_make_server: Callable[..., LiveServer], backend: str
) -> None:
    """asyncio serves through uvicorn (serve_http), trio through hypercorn."""
    server = hybridkv_make_server(backend=backend)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    done = client.completions.create(model=server.model, prompt="w2 w3", max_tokens=4)
    assert done.usage is not None and done.usage.completion_tokens >= 1
    chunks = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "w5 w6"}],
        max_tokens=4,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    stats = server.wait_until_free()
    assert stats.num_finished == 2


def test_serve_http_on_trio_says_to_use_hypercorn() -> None:
    async def main() -> None:
        sock = open_socket("127.0.0.1", 0)
        try:
            await serve_http(lambda scope, receive, send: None, sock)  # type: ignore[arg-type]
        finally:
            sock.close()

    with pytest.raises(ServeBackendError, match="serve_hypercorn"):
        anyio.run(main, backend="trio")


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_serve_hypercorn_serves_the_app_on_both_loops(backend: str) -> None:
    config = default_config()

    async def main() -> httpx.Response:
        sock = open_socket("127.0.0.1", 0)
        url = f"http://127.0.0.1:{bound_port(sock)}/v1/completions"
        async with Engine(config, FakeExecutor.for_config(config)) as engine:
            app = build_app(engine, word_tokenizer(), model_name="m", max_model_len=256)
            async with anyio.create_task_group() as tg:
                server = await tg.start(serve_hypercorn, app, sock)
                async with httpx.AsyncClient() as client:
                    body = {"model": "m", "prompt": "w2 w3", "max_tokens": 3}
                    reply = await client.post(url, json=body)
                server.should_exit = True
        return reply

    reply = anyio.run(main, backend=backend)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] >= 1


def test_connection_limits_are_refused_on_trio() -> None:
    from hybridkv.serving.http.connection import ConnectionLimits

    config = default_config()
    with (
        pytest.raises(ValueError, match="uvicorn"),
        live_server(
            config,
            FakeExecutor.for_config(config),
            tokenizer=word_tokenizer(),
            limits=ConnectionLimits(),
            backend="trio",
        ),
    ):
        pass


def test_the_leak_checks_name_pages_nothing_will_free() -> None:
    """A page taken behind the engine's back: the live wait gives up with what is held,
    and so does the check after the engine stopped."""
    config = default_config(policies=[FullAttention()])
    engine = Engine(config, FakeExecutor.for_config(config))

    class Stray:
        request_id, all_token_ids, extra_keys = "stray", [5, 6, 7, 8, 9], ()

    async def main() -> None:
        async with engine:
            await wait_until_free(engine)  # nothing held yet
            assert engine.core.kv.allocate(Stray(), 5) is not None
            with pytest.raises(LeakError, match=r"pages held per group \[2\]"):
                await wait_until_free(engine, timeout=0.05)  # nothing will free them

    anyio.run(main)
    with pytest.raises(LeakError, match="the engine holds"):
        check_no_leaks(engine)


def test_the_tiny_checkpoint_generates_what_transformers_does(hybridkv_tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from hybridkv.executor import LoadOptions, ModelExecutor
    from hybridkv.scheduler import EngineConfig
    from hybridkv.testing import byte_tokenizer

    executor = ModelExecutor.from_pretrained(
        hybridkv_tiny_model, LoadOptions(kv_cache_bytes=1 << 20, block_size=4)
    )
    config = EngineConfig.for_executor(executor, max_model_len=64)
    prompt = byte_tokenizer().encode("héllo 🙂").ids

    async def main() -> list[int]:
        tokens: list[int] = []
        async with Engine(config, executor) as engine:
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            async with engine.generate(prompt, params) as stream:
                async for out in stream:
                    tokens += out.new_token_ids
        return tokens

    tokens = anyio.run(main)
    reference = AutoModelForCausalLM.from_pretrained(hybridkv_tiny_model)
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0
        )
    assert tokens == expected[0, len(prompt) :].tolist()
