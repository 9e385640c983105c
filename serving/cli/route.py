"""``hybridkv route``: one OpenAI-compatible front end over running ``hybridkv serve``
replicas, and the front end ``serve --data-parallel-size`` runs over the ones it starts.

::

    hybridkv serve MODEL --port 8001 --kv-events-config '{"enable_kv_cache_events": true,
        "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'     (each replica)
    hybridkv route MODEL --replica http://a:8001 --replica http://b:8001 --port 8000

The front end reads MODEL's tokenizer and chat template (not its weights) to see each
prompt's tokens as the replicas will, asks every replica's ``/kv_events`` where it
publishes, and routes as ``--routing`` says (``hybridkv.serving.router.replicas``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import attrs

from hybridkv.serving.cli.flags.console import add_log_level_argument, configure_logging
from hybridkv.serving.cli.flags.engine import add_model_argument
from hybridkv.serving.cli.flags.serve import add_transport_arguments

#: A task the front end runs beside serving, given the replica set (a process watcher).
Companion = Callable[[Any], Coroutine[Any, Any, None]]


def _seconds(text: str) -> float:
    """A positive number of seconds (an interval of 0 would poll without pause)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def add_routing_arguments(parser: argparse.ArgumentParser | Any) -> None:
    """``--routing``, ``--health-interval``, ``--load-interval`` and ``--loop`` (route,
    and serve's data parallelism)."""
    from hybridkv.serving.router.replicas import POLICIES

    parser.add_argument(
        "--loop",
        choices=("auto", "asyncio", "uvloop"),
        default="auto",
        help="the front end's event loop: uvloop where it is installed (auto, the "
        "default), asyncio's own, or uvloop (refused where it is not installed)",
    )
    parser.add_argument(
        "--routing",
        choices=POLICIES,
        default="prefix",
        help="how requests are spread over replicas: prefix (what every layer group of a "
        "replica can resume, against its load; the default), prefix-full-attention (the "
        "full-attention groups' prefix alone), least-loaded, round-robin",
    )
    parser.add_argument(
        "--health-interval",
        type=_seconds,
        default=5.0,
        metavar="S",
        help="seconds between probes of every replica's /health (5)",
    )
    parser.add_argument(
        "--load-interval",
        type=_seconds,
        default=0.1,
        metavar="S",
        help="seconds between polls of every replica's /load, the free pages the prefix "
        "policies weigh (0.1)",
    )


def register_route(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``hybridkv route [MODEL] --replica URL ...``."""
    parser = subparsers.add_parser(
        "route",
        help="serve one OpenAI-compatible address over several hybridkv serve replicas",
        description="Route requests over running `hybridkv serve` replicas by the prefix\n"
        "every layer group of each can resume (from their KV events) against their load.\n"
        "MODEL gives the tokenizer and chat template only.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_argument(parser)
    parser.add_argument(
        "--replica",
        action="append",
        required=True,
        metavar="URL",
        help="a replica's base URL (http://host:port); repeat for each",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    add_transport_arguments(parser)
    parser.add_argument(
        "--chat-template", metavar="FILE", help="the replicas' --chat-template, if they have one"
    )
    add_routing_arguments(parser)
    add_log_level_argument(parser, "info")
    parser.set_defaults(handler=run_route)


def run_route(args: argparse.Namespace) -> int:
    """Serve the front end over ``--replica`` URLs until interrupted."""
    from hybridkv.serving.http.uvicorn_server import open_socket
    from hybridkv.serving.router.replicas import Replica

    configure_logging(args.log_level, args.log_format)
    replicas = [Replica(str(i), _base_url(url)) for i, url in enumerate(args.replica)]
    settings = front_end_settings(args)
    sock = open_socket(args.host, args.port)
    with sock:
        prompter = load_prompter(
            args.model_flag or args.model, args.chat_template, getattr(args, "revision", None)
        )
        with contextlib.suppress(KeyboardInterrupt):
            run_front_end(args.loop, serve_front_end, args, settings, replicas, prompter, sock, ())
    return 0


def run_front_end(loop: str, main: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """``anyio.run(main, *args)`` on the event loop ``--loop`` names (``auto``: uvloop
    where it is installed, as uvicorn and vLLM's API server do).

    The front end does no model work: its time is the loop's, forwarding bytes. On
    ``python -m benchmarks.routing.front_end_overhead --concurrency 8 --rounds 40
    --max-tokens 16`` its CPU time per request was 2.45-2.57x smg's on asyncio's own
    loop and 2.09-2.14x on uvloop, three runs each (docs/benchmarks.md).
    """
    import anyio

    if loop == "asyncio" or not _has_uvloop():  # --loop uvloop was checked at start
        return anyio.run(main, *args)
    return anyio.run(main, *args, backend_options={"use_uvloop": True})


def _has_uvloop() -> bool:
    import importlib.util

    return importlib.util.find_spec("uvloop") is not None


@attrs.frozen(kw_only=True)
class FrontEndSettings:
    """What the transport flags set for a front end: its own access checks, limits and
    connection limits, as a replica's, and how long it waits on a replica."""

    api_key: str | None
    allowed_hosts: tuple[str, ...]
    allowed_origins: tuple[str, ...]
    max_body_bytes: int
    body_timeout_s: float
    limits: Any  # ConnectionLimits
    timeouts: Any  # UpstreamTimeouts


def front_end_settings(args: argparse.Namespace) -> FrontEndSettings:
    """The transport flags read and checked (before any replica starts).

    Raises:
        UsageError: a value out of range, naming the flag.
    """
    from hybridkv.serving.cli.flags.serve import (
        allowed_origins,
        byte_size,
        connection_limits,
        host_names,
    )
    from hybridkv.serving.cli.flags.values import UsageError
    from hybridkv.serving.router.front_end import UpstreamTimeouts

    try:
        limits = connection_limits(args)
        origins = allowed_origins(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    max_body_bytes = byte_size(args, "--max-body-size")
    if args.loop == "uvloop" and not _has_uvloop():
        raise UsageError("--loop uvloop: uvloop is not installed (pip install uvloop)")
    wait = args.step_timeout or None  # 0: no limit, as the replicas' watchdog
    return FrontEndSettings(
        api_key=args.api_key,
        allowed_hosts=host_names(args),
        allowed_origins=origins,
        max_body_bytes=max_body_bytes,
        body_timeout_s=args.timeout_body,
        limits=limits,
        timeouts=UpstreamTimeouts(first_byte_s=wait, stall_s=wait),
    )


def _base_url(url: str) -> str:
    from hybridkv.serving.cli.flags.values import UsageError

    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--replica {url!r} is not an http:// or https:// URL")
    return url.rstrip("/").removesuffix("/v1")


def load_prompter(model: str | None, chat_template: str | None, revision: str | None = None) -> Any:
    """A prompter over MODEL's tokenizer and chat template (its weights stay unread)."""
    import anyio
    from tokenizers import Tokenizer

    from hybridkv.serving.cli.builtin_models import resolve_model
    from hybridkv.serving.cli.flags.serve import read_chat_template, written_over
    from hybridkv.serving.cli.flags.values import UsageError
    from hybridkv.serving.openai.chat_template import ChatTemplate
    from hybridkv.serving.openai.prompts import Prompter

    _, folder = resolve_model(model, revision=revision)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise UsageError(f"the checkpoint {str(folder)!r} has no tokenizer.json")
    template = ChatTemplate.from_checkpoint(folder)
    written = read_chat_template(chat_template)
    if written is not None:
        template = written_over(written, template)
    # The replicas hold the context limit; a prompt longer than this one is theirs to
    # refuse, so the front end's bound is only the cheap size check's.
    return Prompter(
        Tokenizer.from_file(str(path)),
        template,
        max_model_len=2**24,
        limiter=anyio.CapacityLimiter(4),
    )


async def serve_front_end(
    args: argparse.Namespace,
    settings: FrontEndSettings,
    replicas: Sequence[Any],
    prompter: Any,
    sock: Any,
    companions: Sequence[Companion],
    *,
    ready: Callable[[Any], Awaitable[None]] | None = None,
) -> None:
    """Probe the replicas, then serve the front end on ``sock`` (``ready``: awaited once
    the set exists, before serving: a wait for replicas that are starting)."""
    import anyio
    import httpx

    from hybridkv.serving.http.uvicorn_server import serve_http_in
    from hybridkv.serving.router.front_end import Forwarder, build_route_app
    from hybridkv.serving.router.replicas import ReplicaSet

    timeout = httpx.Timeout(None, connect=10.0)  # each forward sets its own (router/front_end.py)
    pool = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout, limits=pool) as client:
        routed = ReplicaSet(replicas, client, args.routing)
        try:
            if ready is not None:
                await ready(routed)
            else:
                async with anyio.create_task_group() as tg:
                    for replica in replicas:
                        tg.start_soon(routed.probe, replica)
            forwarder = Forwarder(
                routed,
                prompter,
                max_body_bytes=settings.max_body_bytes,
                body_timeout_s=settings.body_timeout_s,
                timeouts=settings.timeouts,
                api_key=settings.api_key,
            )
            app = build_route_app(
                forwarder,
                api_key=settings.api_key,
                allowed_hosts=settings.allowed_hosts,
                allowed_origins=settings.allowed_origins,
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(routed.watch, args.health_interval)
                tg.start_soon(routed.watch_load, args.load_interval)
                for companion in companions:
                    tg.start_soon(companion, routed)
                await serve_http_in(tg, app, sock, log_level=args.log_level, limits=settings.limits)
                host, port = sock.getsockname()[:2]
                serving = ", ".join(f"{r.name}={r.url}" for r in routed.healthy) or "none yet"
                print(
                    f"routing at http://{host}:{port}/v1 over {len(replicas)} replicas "
                    f"({args.routing}; serving: {serving}); Ctrl-C stops",
                    file=sys.stderr,
                    flush=True,
                )
        finally:
            await routed.aclose()
