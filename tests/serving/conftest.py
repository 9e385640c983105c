"""A live server on a loopback port: the engine on the fake executor, a word tokenizer.

The server runs in its own event loop thread (an anyio blocking portal), as it would in
production; tests talk to it over HTTP with the official ``openai`` client or httpx, and
read engine state through the portal (on the loop's thread).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import anyio
import anyio.abc
import attrs
import pytest
import uvicorn
from anyio.from_thread import BlockingPortal, start_blocking_portal
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from hybridkv.policies import FullAttention, SlidingWindow
from hybridkv.scheduler import Engine, EngineConfig, EngineStats, FakeExecutor
from hybridkv.serving.app import ServerOptions, build_app
from hybridkv.serving.chat import ChatTemplate
from hybridkv.serving.server import bound_port, open_socket, serve_http

MODEL = "fake-model"
MAX_MODEL_LEN = 256
EOS_ID = 1


def word_tokenizer(num_words: int = 62) -> Tokenizer:
    """A whitespace word-level tokenizer: ``[UNK]``, ``<eos>``, then ``w2 .. w63``."""
    vocab = {"[UNK]": 0, "<eos>": EOS_ID}
    vocab.update({f"w{i}": i for i in range(2, num_words + 2)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.add_special_tokens(["<eos>"])
    return tokenizer


@pytest.fixture(name="word_tokenizer")
def word_tokenizer_fixture() -> Tokenizer:
    """The word-level test tokenizer."""
    return word_tokenizer()


@attrs.frozen
class LiveServer:
    """A running server: its URL, engine, app, and the portal into its loop."""

    url: str
    engine: Engine
    app: Any
    portal: BlockingPortal
    executor: FakeExecutor

    def stats(self) -> EngineStats:
        """The engine's stats, read on the loop's thread."""
        return self.portal.call(self.engine.stats)

    def wait_until_free(self, timeout: float = 10.0) -> EngineStats:
        """The stats once no request runs or waits and no page is held.

        An abort frees a request's pages once the step running it returns, so this
        polls; it raises TimeoutError if pages stay held (a leak).
        """

        async def idle() -> EngineStats:
            with anyio.fail_after(timeout):
                while True:
                    stats = self.engine.stats()
                    if (
                        stats.num_running + stats.num_waiting + sum(stats.blocks_used_per_group)
                        == 0
                    ):
                        return stats
                    await anyio.sleep(0.01)

        return self.portal.call(idle)


def _engine_config(**overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = {
        "policies": [FullAttention(), SlidingWindow(window=32)],
        "num_blocks": 256,
        "block_size": 4,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 128,
        "eos_token_ids": [EOS_ID],
        "vocab_size": 64,
    }
    settings.update(overrides)
    return EngineConfig(**settings)


async def _run(
    config: EngineConfig,
    executor: FakeExecutor,
    options: ServerOptions,
    *,
    task_status: anyio.abc.TaskStatus[tuple[Engine, Any, uvicorn.Server, int]],
) -> None:
    sock = open_socket("127.0.0.1", 0)
    port = bound_port(sock)
    async with Engine(config, executor) as engine:
        app = build_app(
            engine,
            word_tokenizer(),
            model_name=MODEL,
            max_model_len=config.max_model_len,
            chat_template=ChatTemplate.plain(),
            options=options,
        )
        async with anyio.create_task_group() as tg:
            server = await tg.start(serve_http, app, sock)
            task_status.started((engine, app, server, port))


@pytest.fixture
def make_server() -> Iterator[Callable[..., LiveServer]]:
    """Start servers with chosen engine settings; stop them all after the test."""
    with start_blocking_portal() as portal:
        stops: list[Callable[[], None]] = []

        def start(
            *,
            step_delay_s: float = 0.0,
            options: ServerOptions | None = None,
            executor_class: type[FakeExecutor] = FakeExecutor,
            **config: Any,
        ) -> LiveServer:
            engine_config = _engine_config(**config)
            executor = executor_class.for_config(engine_config, step_delay_s=step_delay_s)
            future, (engine, app, server, port) = portal.start_task(
                _run, engine_config, executor, options or ServerOptions()
            )

            def stop() -> None:
                portal.call(setattr, server, "should_exit", True)
                future.result(timeout=30)

            stops.append(stop)
            return LiveServer(f"http://127.0.0.1:{port}", engine, app, portal, executor)

        yield start
        for stop in stops:
            stop()


@pytest.fixture
def server(make_server: Callable[..., LiveServer]) -> LiveServer:
    """A server with default settings."""
    return make_server()


@pytest.fixture
def client(server: LiveServer) -> Iterator[Any]:
    """The official OpenAI client pointed at the server."""
    import openai

    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c
