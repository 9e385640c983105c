"""The server of hostile_clients.py, in a child process: the engine on a fake executor (the
real sampler on a byte vocabulary for the structured-output case) behind the app."""

from __future__ import annotations

import sys
from typing import Any

MODEL = "fake-model"
HOST = "127.0.0.1"
MAX_CONNECTIONS = 1000  # the server's default cap, held by case 3
BYTE_EOS = 256


# -- the server (a child process) ----------------------------------------------------------


def word_tokenizer(num_words: int = 62) -> Any:
    """The tests' whitespace word-level tokenizer: ``[UNK]``, ``<eos>``, ``w2 .. w63``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<eos>": 1} | {f"w{i}": i for i in range(2, num_words + 2)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.add_special_tokens(["<eos>"])
    return tokenizer


def byte_tokenizer() -> Any:
    """The tests' byte-level tokenizer: one token per byte, then ``<eos>`` (256)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<eos>", special=True)])
    return tokenizer


def sampling_fake_executor_class() -> type:
    """The tests' ``SamplingFakeExecutor``: the fake, with random logits per position that
    the real sampler samples (structured output applies), on the byte vocabulary."""
    import torch

    from hybridkv.executor.sampler import Sampler
    from hybridkv.scheduler import FakeExecutor, StepBatch, StepResult
    from hybridkv.scheduler.params import StructuredOutput

    class SamplingFakeExecutor(FakeExecutor):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.sampler = Sampler(eos_token_ids=[BYTE_EOS], seed=0)
            self.tokenizer = byte_tokenizer()

        def compile_grammar(self, spec: StructuredOutput) -> None:
            self.sampler.compile_grammar(spec, self.tokenizer, BYTE_EOS + 1)

        def execute(self, batch: StepBatch) -> StepResult:
            fake = super().execute(batch)
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
            position = request.start_position + request.num_tokens - 1
            h = self._read(request.block_tables, position)
            generator = torch.Generator().manual_seed(h & 0x7FFFFFFF)
            return torch.randn(self.vocab_size, generator=generator) * 3

    return SamplingFakeExecutor


def serve(case: str) -> None:
    """Serve the case's engine on a free loopback port (printed) until stdin closes."""
    import functools

    import anyio

    from hybridkv.policies import FullAttention, SlidingWindow
    from hybridkv.scheduler import Engine, EngineConfig, FakeExecutor
    from hybridkv.serving.app import build_app
    from hybridkv.serving.chat import ChatTemplate
    from hybridkv.serving.cli.console import configure_logging
    from hybridkv.serving.connection import ConnectionLimits
    from hybridkv.serving.server import bound_port, open_socket, serve_http

    configure_logging("warning")
    settings: dict[str, Any] = {
        "policies": [FullAttention(), SlidingWindow(window=32)],
        "num_blocks": 1024,
        "block_size": 4,
        "max_model_len": 256,
        "max_num_seqs": 32,
        "max_num_batched_tokens": 128,
        "eos_token_ids": [1],
        "vocab_size": 64,
    }
    executor_class: type[FakeExecutor] = FakeExecutor
    tokenizer = word_tokenizer()
    if case == "2":
        settings.update(vocab_size=BYTE_EOS + 1, eos_token_ids=[BYTE_EOS])
        executor_class = sampling_fake_executor_class()
        tokenizer = byte_tokenizer()
    elif case == "7":
        settings.update(max_model_len=8300, num_blocks=4400, max_num_batched_tokens=2048)
    config = EngineConfig(**settings)
    executor = executor_class.for_config(config)
    limits = ConnectionLimits(max_connections=MAX_CONNECTIONS)

    async def main() -> None:
        sock = open_socket(HOST, 0)
        port = bound_port(sock)
        async with Engine(config, executor) as engine:
            app = build_app(
                engine,
                tokenizer,
                model_name=MODEL,
                max_model_len=config.max_model_len,
                chat_template=ChatTemplate.plain(),
            )
            async with anyio.create_task_group() as tg:
                server = await tg.start(functools.partial(serve_http, limits=limits), app, sock)
                print(port, flush=True)
                await anyio.to_thread.run_sync(sys.stdin.read)  # the driver closes it
                server.should_exit = True

    anyio.run(main)
