"""The server of hostile_clients.py, in a child process: the engine on a fake executor (the
real sampler on a byte vocabulary for the structured-output case) behind the app."""

from __future__ import annotations

import sys
from typing import Any

MODEL = "fake-model"
HOST = "127.0.0.1"
MAX_CONNECTIONS = 1000  # the server's default cap, held by case 3


# -- the server (a child process) ----------------------------------------------------------


def serve(case: str) -> None:
    """Serve the case's engine on a free loopback port (printed) until stdin closes."""
    import functools

    import anyio

    from hybridkv.policies import FullAttention, SlidingWindow
    from hybridkv.scheduler import Engine, EngineConfig, FakeExecutor
    from hybridkv.serving.cli.flags.console import configure_logging
    from hybridkv.serving.http.app import build_app
    from hybridkv.serving.http.connection import ConnectionLimits
    from hybridkv.serving.http.uvicorn_server import bound_port, open_socket, serve_http
    from hybridkv.serving.openai.chat_template import ChatTemplate
    from hybridkv.testing import BYTE_EOS, SamplingFakeExecutor, byte_tokenizer, word_tokenizer

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
        executor_class = SamplingFakeExecutor
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


def serve_front_end(case: str, replica_command: list[str]) -> None:
    """The front end of ``serve -dp`` over two replicas of the case (each the server
    above, in a process of its own): on a free loopback port (printed) until stdin
    closes, with the same connection cap as a replica."""
    import subprocess

    import anyio
    import httpx

    from hybridkv.serving.cli.flags.console import configure_logging
    from hybridkv.serving.http.connection import ConnectionLimits
    from hybridkv.serving.http.uvicorn_server import bound_port, open_socket, serve_http_in
    from hybridkv.serving.openai.chat_template import ChatTemplate
    from hybridkv.serving.openai.prompts import Prompter
    from hybridkv.serving.router.front_end import Forwarder, build_route_app
    from hybridkv.serving.router.replicas import Replica, ReplicaSet
    from hybridkv.testing import byte_tokenizer, word_tokenizer

    configure_logging("warning")
    processes = [
        subprocess.Popen(replica_command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    ports = [int(p.stdout.readline()) for p in processes if p.stdout is not None]
    tokenizer = byte_tokenizer() if case == "2" else word_tokenizer()

    async def main() -> None:
        prompter = Prompter(
            tokenizer, ChatTemplate.plain(), max_model_len=2**24, limiter=anyio.CapacityLimiter(4)
        )
        replicas = [Replica(str(i), f"http://{HOST}:{port}") for i, port in enumerate(ports)]
        timeout = httpx.Timeout(None, connect=10.0)
        pool = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout, limits=pool) as client:
            routed = ReplicaSet(replicas, client, "least-loaded")
            for replica in replicas:
                await routed.probe(replica)
            sock = open_socket(HOST, 0)
            app = build_route_app(Forwarder(routed, prompter))
            limits = ConnectionLimits(max_connections=MAX_CONNECTIONS)
            async with anyio.create_task_group() as tg:
                tg.start_soon(routed.watch, 5.0)
                server = await serve_http_in(tg, app, sock, limits=limits)
                print(bound_port(sock), flush=True)
                await anyio.to_thread.run_sync(sys.stdin.read)  # the driver closes it
                server.should_exit = True
            await routed.aclose()

    try:
        anyio.run(main)
    finally:
        for process in processes:
            if process.stdin is not None:
                process.stdin.close()
        for process in processes:
            process.wait(timeout=60)
