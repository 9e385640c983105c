"""Live servers on loopback ports (``hybridkv.testing.server``): the engine on a fake
executor, a word tokenizer.

Each server runs in an event loop thread (an anyio blocking portal), as it would in
production; tests talk to it over HTTP with the official ``openai`` client or httpx, and
read engine state through the portal (on the loop's thread).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from anyio.from_thread import start_blocking_portal
from tokenizers import Tokenizer, models, pre_tokenizers

from hybridkv.policies import FullAttention, SlidingWindow
from hybridkv.scheduler import FakeExecutor
from hybridkv.testing import (
    BYTE_EOS,
    LiveServer,
    SamplingFakeExecutor,
    byte_tokenizer,
    default_config,
    live_server,
    word_tokenizer,
)

MODEL = "fake-model"
MAX_MODEL_LEN = 256


@pytest.fixture(name="word_tokenizer")
def word_tokenizer_fixture() -> Tokenizer:
    """The word-level test tokenizer."""
    return word_tokenizer()


@pytest.fixture
def make_server() -> Iterator[Callable[..., LiveServer]]:
    """Start servers with chosen engine settings (one loop thread for all of them); stop
    them all after the test."""
    with start_blocking_portal() as portal, contextlib.ExitStack() as stack:

        def start(
            *,
            step_delay_s: float = 0.0,
            executor_class: type[FakeExecutor] = FakeExecutor,
            wrap: Callable[[FakeExecutor], Any] | None = None,
            tokenizer: Tokenizer | None = None,
            **kwargs: Any,
        ) -> LiveServer:
            live = {
                "options",
                "limits",
                "chat_template",
                "send_buffer",
                "wrap_app",
                "proposer",
                "kv_events",
            }
            server_kw = {k: kwargs.pop(k) for k in live & kwargs.keys()}
            kwargs.setdefault("policies", [FullAttention(), SlidingWindow(window=32)])
            if executor_class is SamplingFakeExecutor:
                kwargs.setdefault("vocab_size", BYTE_EOS + 1)
                kwargs.setdefault("eos_token_ids", [BYTE_EOS])
                tokenizer = tokenizer or byte_tokenizer()
            config = default_config(**kwargs)
            executor = executor_class.for_config(config, step_delay_s=step_delay_s)
            server = live_server(
                config,
                executor if wrap is None else wrap(executor),
                tokenizer=tokenizer or word_tokenizer(),
                model=MODEL,
                portal=portal,
                **server_kw,
            )
            return stack.enter_context(server)

        yield start


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


@pytest.fixture
def hermes_server(make_server: Callable[..., LiveServer]) -> LiveServer:
    """A server whose model writes ``tool_samples.HERMES`` (a Hermes-style call after some
    text), with ``--tool-call-parser hermes --enable-auto-tool-choice``."""
    from tool_samples import HERMES, ScriptedExecutor

    from hybridkv.serving.http.app import ServerOptions

    ScriptedExecutor.script = HERMES
    return make_server(
        executor_class=ScriptedExecutor,
        tokenizer=byte_tokenizer(),
        vocab_size=BYTE_EOS + 1,
        eos_token_ids=[BYTE_EOS],
        options=ServerOptions(tool_call_parser="hermes", enable_auto_tool_choice=True),
    )


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
