"""The pytest plugin of hybridkv (entry point ``pytest11``: loaded wherever hybridkv is
installed; ``-p no:hybridkv`` turns it off). Its fixtures, all prefixed ``hybridkv_``:

``hybridkv_engine``
    A factory of engines on the fake executor: ``async with hybridkv_engine() as engine``
    in any async test (pytest-asyncio, or anyio's plugin on asyncio or trio: the test's
    own loop runs it). Keywords override the config (``policies=[...]``,
    ``num_blocks=...``, see :func:`default_config`); ``executor_class=`` picks another
    fake (``AttendingFakeExecutor``, ``SamplingFakeExecutor``), ``executor=`` passes one
    built for that config. The engine's executor is ``engine.executor``. At teardown
    every engine made is checked for leaks (:func:`~hybridkv.testing.check_no_leaks`).
``hybridkv_server``
    A :class:`~hybridkv.testing.LiveServer` on a loopback port (asyncio, uvicorn), the
    word tokenizer, model ``fake-model``; ``hybridkv_make_server(backend="trio", ...)``
    starts others (keywords as ``hybridkv_engine``'s, plus ``live_server``'s).
``hybridkv_tiny_model``
    A tiny random Llama checkpoint folder with the byte tokenizer, made once a session
    (skipped where transformers is missing).

Nothing here imports torch or the server until a fixture is used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from hybridkv.scheduler import Engine, EngineConfig
    from hybridkv.testing.server import LiveServer


def default_config(**overrides: Any) -> EngineConfig:
    """The fixtures' engine config: full attention, 256 pages of 4 tokens, 256 positions,
    8 sequences, the word tokenizer's vocabulary and ``<eos>``; ``overrides`` replace."""
    from hybridkv.policies import FullAttention
    from hybridkv.scheduler import EngineConfig
    from hybridkv.testing.sample_tokenizers import WORD_EOS

    settings: dict[str, Any] = {
        "policies": [FullAttention()],
        "num_blocks": 256,
        "block_size": 4,
        "max_model_len": 256,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 128,
        "eos_token_ids": [WORD_EOS],
        "vocab_size": 64,
    }
    return EngineConfig(**(settings | overrides))


@pytest.fixture
def hybridkv_engine() -> Iterator[Callable[..., Engine]]:
    """``make(executor_class=FakeExecutor, executor=None, **config) -> Engine``, to enter
    with ``async with``; every engine made is checked for leaks after the test."""
    from hybridkv.scheduler import Engine, FakeExecutor
    from hybridkv.testing.leaks import check_no_leaks

    made: list[Engine] = []

    def make(
        executor_class: type[FakeExecutor] = FakeExecutor, executor: Any = None, **config: Any
    ) -> Engine:
        engine_config = default_config(**config)
        engine = Engine(engine_config, executor or executor_class.for_config(engine_config))
        made.append(engine)
        return engine

    yield make
    for engine in made:
        if engine.is_running:
            raise AssertionError("an engine of hybridkv_engine was left running: exit it")
        check_no_leaks(engine)


@pytest.fixture
def hybridkv_make_server() -> Iterator[Callable[..., LiveServer]]:
    """``start(executor_class=FakeExecutor, executor=None, tokenizer=None, **config)``: a
    live server, stopped after the test (``live_server``'s keywords, ``backend=`` among
    them, pass through)."""
    import contextlib

    from hybridkv.scheduler import FakeExecutor
    from hybridkv.testing.sample_tokenizers import word_tokenizer
    from hybridkv.testing.server import live_server

    live = {"options", "chat_template", "limits", "backend", "model", "send_buffer", "wrap_app"}
    with contextlib.ExitStack() as stack:

        def start(
            executor_class: type[FakeExecutor] = FakeExecutor,
            executor: Any = None,
            tokenizer: Any = None,
            **kwargs: Any,
        ) -> LiveServer:
            server_kw = {k: kwargs.pop(k) for k in live & kwargs.keys()}
            config = default_config(**kwargs)
            return stack.enter_context(
                live_server(
                    config,
                    executor or executor_class.for_config(config),
                    tokenizer=tokenizer or word_tokenizer(),
                    **server_kw,
                )
            )

        yield start


@pytest.fixture
def hybridkv_server(hybridkv_make_server: Callable[..., LiveServer]) -> LiveServer:
    """A live server with the default settings (asyncio)."""
    return hybridkv_make_server()


@pytest.fixture(scope="session")
def hybridkv_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the byte tokenizer, written once a session."""
    pytest.importorskip("transformers")
    from hybridkv.testing.tiny_models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("hybridkv-tiny-llama"))
