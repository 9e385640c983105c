"""A live server on a loopback port: the engine on the fake executor, a word tokenizer.

The server runs in its own event loop thread (an anyio blocking portal), as it would in
production; tests talk to it over HTTP with the official ``openai`` client or httpx, and
read engine state through the portal (on the loop's thread).
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import attrs
import pytest
import uvicorn
from anyio.from_thread import BlockingPortal, start_blocking_portal
from tokenizer_samples import BYTE_EOS, byte_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from hybridkv.policies import FullAttention, SlidingWindow
from hybridkv.scheduler import (
    Engine,
    EngineConfig,
    EngineStats,
    FakeExecutor,
    StepBatch,
    StepResult,
)
from hybridkv.scheduler.params import StructuredOutput
from hybridkv.serving.app import ServerOptions, build_app
from hybridkv.serving.chat import ChatTemplate
from hybridkv.serving.connection import ConnectionLimits
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


class SamplingFakeExecutor(FakeExecutor):
    """The fake, with logits: each position's hash seeds a row of random logits, which
    the real sampler samples (penalties, bias, min-p, structured output all apply).

    Meant for the byte tokenizer (vocabulary 257): the server's text is then any bytes.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from hybridkv.executor.sampler import Sampler

        super().__init__(*args, **kwargs)
        self.sampler = Sampler(eos_token_ids=[BYTE_EOS], seed=0)
        self.tokenizer = byte_tokenizer()

    def compile_grammar(self, spec: StructuredOutput) -> None:
        """Compile ahead, as the model executor does (the server calls it off the step)."""
        self.sampler.compile_grammar(spec, self.tokenizer, BYTE_EOS + 1)

    def execute(self, batch: StepBatch) -> StepResult:
        import torch

        fake = super().execute(batch)  # writes and checks the pages, as the fake does
        rows = [i for i, r in enumerate(batch.requests) if r.sample]
        if not rows:
            return fake
        logits = torch.stack([self._logits(batch.requests[i]) for i in rows])
        sampled = self.sampler.sample(
            logits, [batch.requests[i] for i in rows], tokenizer=self.tokenizer
        )
        tokens = list(fake.token_ids)
        for i, token in zip(rows, sampled, strict=True):
            tokens[i] = token
        return StepResult(token_ids=tuple(tokens), prompt_logprobs=fake.prompt_logprobs)

    def _logits(self, request: Any) -> Any:
        import torch

        h = self._read(request.block_tables, request.start_position + request.num_tokens - 1)
        generator = torch.Generator().manual_seed(h & 0x7FFFFFFF)
        return torch.randn(self.vocab_size, generator=generator) * 3


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

    def wait_until_running(self, num_requests: int = 1, timeout: float = 60.0) -> None:
        """Return once ``num_requests`` requests run (the server has queued them)."""

        async def busy() -> None:
            with anyio.fail_after(timeout):
                await self.engine.wait_until(lambda s: s.num_running >= num_requests)

        self.portal.call(busy)

    def wait_until_free(self, timeout: float = 60.0) -> EngineStats:
        """The stats once no request runs or waits and no page is held.

        An abort frees a request's pages once the step running it returns, so this
        waits for that; it raises TimeoutError if pages stay held (a leak).
        """

        def is_free(s: EngineStats) -> bool:
            return s.num_running + s.num_waiting + sum(s.blocks_used_per_group) == 0

        async def idle() -> EngineStats:
            with anyio.fail_after(timeout):
                return await self.engine.wait_until(is_free)

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


@attrs.frozen(kw_only=True)
class _Setup:
    config: EngineConfig
    executor: Any
    options: ServerOptions
    limits: ConnectionLimits
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    send_buffer: int | None


async def _run(
    setup: _Setup,
    *,
    task_status: anyio.abc.TaskStatus[tuple[Engine, Any, uvicorn.Server, int]],
) -> None:
    sock = open_socket("127.0.0.1", 0)
    if setup.send_buffer is not None:  # accepted sockets inherit it (Linux)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, setup.send_buffer)
    port = bound_port(sock)
    async with Engine(setup.config, setup.executor) as engine:
        app = build_app(
            engine,
            setup.tokenizer,
            model_name=MODEL,
            max_model_len=setup.config.max_model_len,
            chat_template=setup.chat_template,
            options=setup.options,
        )
        async with anyio.create_task_group() as tg:
            serve = functools.partial(serve_http, limits=setup.limits)
            server = await tg.start(serve, app, sock)
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
            limits: ConnectionLimits | None = None,
            executor_class: type[FakeExecutor] = FakeExecutor,
            wrap: Callable[[FakeExecutor], Any] | None = None,
            tokenizer: Tokenizer | None = None,
            chat_template: ChatTemplate | None = None,
            send_buffer: int | None = None,
            **config: Any,
        ) -> LiveServer:
            if executor_class is SamplingFakeExecutor:
                config.setdefault("vocab_size", BYTE_EOS + 1)
                config.setdefault("eos_token_ids", [BYTE_EOS])
                tokenizer = tokenizer or byte_tokenizer()
            engine_config = _engine_config(**config)
            executor = executor_class.for_config(engine_config, step_delay_s=step_delay_s)
            setup = _Setup(
                config=engine_config,
                executor=executor if wrap is None else wrap(executor),
                options=options or ServerOptions(),
                limits=limits or ConnectionLimits(),
                tokenizer=tokenizer or word_tokenizer(),
                chat_template=chat_template or ChatTemplate.plain(),
                send_buffer=send_buffer,
            )
            future, (engine, app, server, port) = portal.start_task(_run, setup)

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


@pytest.fixture
def make_sampling_server(make_server: Callable[..., LiveServer]) -> Callable[..., LiveServer]:
    """Start servers on the sampling fake (real sampler, byte-level vocabulary)."""
    return functools.partial(make_server, executor_class=SamplingFakeExecutor)


@pytest.fixture(name="byte_tokenizer")
def byte_tokenizer_fixture() -> Tokenizer:
    """The byte-level test tokenizer of the sampling fake."""
    return byte_tokenizer()


@pytest.fixture(scope="session")
def make_tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make(layer_types, max_positions, vocab_size)``: a random tiny Gemma 3 of those
    layers, saved with a word tokenizer (``[UNK]``, ``<eos>``, ``w2`` ...) in a new folder."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    def make(layer_types: list[str], max_positions: int, vocab_size: int) -> Path:
        torch.manual_seed(0)
        config = Gemma3TextConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=len(layer_types),
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=8,
            layer_types=layer_types,
            max_position_embeddings=max_positions,
            eos_token_id=1,
        )
        folder = tmp_path_factory.mktemp("tiny-gemma3")
        Gemma3ForCausalLM(config).save_pretrained(folder)
        vocab = {"[UNK]": 0, "<eos>": 1} | {f"w{i}": i for i in range(2, vocab_size)}
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer.save(str(folder / "tokenizer.json"))
        return folder

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(make_tiny_checkpoint: Callable[..., Path]) -> Path:
    """A random two-layer Gemma 3 (one sliding, one full layer) with a word tokenizer, for
    the command tests (vocabulary 64, 2,048 positions)."""
    return make_tiny_checkpoint(["sliding_attention", "full_attention"], 2048, 64)


@pytest.fixture
def command_isolation() -> Iterator[None]:
    """One torch thread; undo the logging set-up the commands do, for the tests after."""
    import structlog
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    structlog.reset_defaults()
