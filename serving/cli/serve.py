"""``hybridkv serve`` (the OpenAI-compatible server) and ``hybridkv generate`` (one prompt)."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Any

from hybridkv.serving.cli.data_parallel import add_data_parallel_arguments
from hybridkv.serving.cli.flags.console import add_log_level_argument, configure_logging
from hybridkv.serving.cli.flags.engine import (
    add_engine_arguments,
    add_model_argument,
    add_scheduling_arguments,
    engine_args,
    scheduling_options,
)
from hybridkv.serving.cli.flags.kv_events import (
    add_kv_events_arguments,
    kv_event_publisher,
    kv_events_config,
)
from hybridkv.serving.cli.flags.offload import add_offload_arguments, offload_config
from hybridkv.serving.cli.flags.serve import (
    add_access_and_limit_arguments,
    byte_size,
    http_settings,
    read_chat_template,
    written_over,
)

_SERVE_EPILOG = """\
examples:
  hybridkv serve                                  # the built-in Gemma 3 270M on :8000
  hybridkv serve ./my-checkpoint --port 9000 --kv-memory 4GiB

then, from any OpenAI client:
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "gemma-3-270m", "prompt": "The sea is", "max_tokens": 20}'

endpoints: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize,
           /version, /health, /metrics
"""


def register_serve(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``hybridkv serve [MODEL]``."""
    parser = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Load a model and serve it over an OpenAI-compatible HTTP API, with\n"
        "streaming, Prometheus metrics at /metrics, and continuous batching over one\n"
        "shared KV pool.",
        epilog=_SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_argument(parser)
    http = parser.add_argument_group("http")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    http.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    http.add_argument(
        "--seed",
        dest="engine_seed",
        type=int,
        default=None,
        help="seed of the sampler for requests that set none (vLLM's --seed)",
    )
    http.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template file (or the template itself) replacing the checkpoint's",
    )
    http.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the name clients pass as 'model' (default: the model's name)",
    )
    http.add_argument(
        "--max-response-size",
        default="64MiB",
        metavar="SIZE",
        help="largest response body, or event of a stream; larger answers are a 400 (64MiB)",
    )
    http.add_argument(
        "--responses-store-size",
        default="256MiB",
        metavar="SIZE",
        help="JSON the Responses API keeps of stored conversations; the oldest are "
        "evicted first (256MiB)",
    )
    http.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="output limit of chat requests that set none (default: the rest of the context)",
    )
    add_log_level_argument(http, "info")
    http.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between engine_stats lines while requests run (10; 0: none)",
    )
    http.add_argument(
        "--disable-log-stats", action="store_true", help="no engine_stats lines (vLLM's flag)"
    )
    add_access_and_limit_arguments(parser)
    add_engine_arguments(parser)
    add_scheduling_arguments(parser)
    add_offload_arguments(parser)
    add_kv_events_arguments(parser)
    add_data_parallel_arguments(parser)
    parser.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, start the engine, serve until interrupted."""
    import anyio
    import attrs

    from hybridkv.serving.cli.flags.values import UsageError
    from hybridkv.serving.cli.loading import load_model
    from hybridkv.serving.http.uvicorn_server import open_socket

    if args.data_parallel_size != 1:
        if args.data_parallel_size < 1:
            raise UsageError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
        from hybridkv.serving.cli.data_parallel import run_data_parallel

        kv_events_config(args)  # a bad one fails before any replica starts
        return run_data_parallel(args)
    configure_logging(args.log_level, args.log_format)
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        raise UsageError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    max_body_bytes = byte_size(args, "--max-body-size")
    max_response_bytes = byte_size(args, "--max-response-size")
    store_bytes = byte_size(args, "--responses-store-size")
    scheduling = scheduling_options(args)
    kv_events_config(args)  # a bad one fails before the model loads
    try:
        settings = http_settings(
            args, max_body_bytes=max_body_bytes, default_max_tokens=args.default_max_tokens
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    options = attrs.evolve(
        settings.options,
        max_response_bytes=max_response_bytes,
        responses_store_bytes=store_bytes,
    )
    settings = attrs.evolve(settings, options=options)
    engine = engine_args(args)  # a refused combination of flags, before the port's error
    sock = open_socket(args.host, args.port)  # fail fast, before the model loads
    template = read_chat_template(args.chat_template)  # a bad one fails before loading
    with sock:  # closed too when the model fails to load
        loaded = load_model(engine)
        loaded = attrs.evolve(
            loaded, engine_config=attrs.evolve(loaded.engine_config, **scheduling)
        )
        if template is not None:
            template = written_over(template, loaded.chat_template)
            loaded = attrs.evolve(loaded, chat_template=template)
        _prepare_structured_output(loaded)
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is the way to stop
            anyio.run(_serve, loaded, sock, settings, args)
    return 0


def _prepare_structured_output(loaded: Any) -> None:
    """Read the vocabulary for grammar masks now (seconds for a large one), not in the
    first step of the first request that asks for structured output."""
    from hybridkv.errors.events import get_logger
    from hybridkv.executor.grammars import GrammarError

    sampler = getattr(loaded.executor, "sampler", None)
    if sampler is not None and hasattr(sampler, "enable_structured_output"):
        try:
            sampler.enable_structured_output(loaded.tokenizer, loaded.executor.vocab_size)
        except GrammarError as exc:  # the rest serves; such requests get a 400 saying why
            get_logger(__name__).warning("structured_output_unavailable", reason=str(exc))


async def _serve(loaded: Any, sock: Any, settings: Any, args: argparse.Namespace) -> None:
    import anyio

    from hybridkv.scheduler import Engine
    from hybridkv.scheduler.watchdog import StepWatchdog
    from hybridkv.serving.http.app import build_app
    from hybridkv.serving.http.uvicorn_server import serve_http_in
    from hybridkv.serving.metrics.stats_log import log_stats

    name = args.served_model_name or loaded.name
    executor = loaded.executor
    if settings.step_timeout_s is not None:
        executor = StepWatchdog(executor, settings.step_timeout_s)
    rank = args.data_parallel_rank
    with kv_event_publisher(kv_events_config(args), data_parallel_rank=rank) as kv_events:
        async with Engine(
            loaded.engine_config,
            executor,
            offload=offload_config(args, loaded.executor),
            proposer=loaded.proposer,
            kv_events=kv_events,
        ) as engine:
            app = build_app(
                engine,
                loaded.tokenizer,
                model_name=name,
                max_model_len=loaded.max_model_len,
                chat_template=loaded.chat_template,
                options=settings.options,
                kv_events=kv_events,
            )
            async with anyio.create_task_group() as tg:
                if args.log_stats_interval > 0 and not args.disable_log_stats:
                    tg.start_soon(log_stats, engine, args.log_stats_interval)
                await serve_http_in(tg, app, sock, log_level=args.log_level, limits=settings.limits)
                host, port = sock.getsockname()[:2]
                print(
                    f"serving {name!r} at http://{host}:{port}/v1 "
                    f"({loaded.engine_config.num_blocks} KV pages); Ctrl-C stops",
                    file=sys.stderr,
                    flush=True,
                )


def register_generate(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``hybridkv generate [MODEL] PROMPT``."""
    parser = subparsers.add_parser(
        "generate",
        help="generate a completion of one prompt, streamed to the terminal",
        description="Load a model and stream the continuation of one prompt to stdout.",
        epilog='example:\n  hybridkv generate "The three laws of robotics are" --max-tokens 40',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_argument(parser)
    parser.add_argument("prompt", metavar="PROMPT", help="the text to continue")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument(
        "--max-tokens", type=int, default=64, metavar="N", help="tokens to generate (64)"
    )
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1)")
    sampling.add_argument("--top-k", type=int, default=0, help="keep the k best tokens (0: all)")
    sampling.add_argument("--seed", type=int, default=None, help="sampling seed")
    sampling.add_argument("--ignore-eos", action="store_true", help="run past end-of-sequence")
    sampling.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    add_log_level_argument(parser, "warning")
    add_engine_arguments(parser, kv_memory="256MiB")
    add_offload_arguments(parser)
    parser.set_defaults(handler=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    """Stream one completion to stdout; print counts on stderr."""
    import anyio

    from hybridkv.scheduler import SamplingParams
    from hybridkv.serving.cli.loading import load_model

    configure_logging(args.log_level, args.log_format)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    loaded = load_model(engine_args(args))
    offload = offload_config(args, loaded.executor)
    anyio.run(_generate, loaded, args.prompt, params, args.chat, offload)
    return 0


async def _generate(loaded: Any, prompt: str, params: Any, chat: bool, offload: Any) -> None:
    from hybridkv.scheduler import Engine
    from hybridkv.serving.openai.text import TextStream, TokenClasses

    if chat:
        text = loaded.chat_template.render([{"role": "user", "content": prompt}])
        ids = loaded.tokenizer.encode(text, add_special_tokens=loaded.chat_template.is_builtin).ids
    else:
        ids = loaded.tokenizer.encode(prompt).ids
    texts = TextStream(loaded.tokenizer, classes=TokenClasses.of(loaded.tokenizer))
    start = time.monotonic()
    first: float | None = None
    async with Engine(
        loaded.engine_config, loaded.executor, offload=offload, proposer=loaded.proposer
    ) as engine:
        async for out in engine.generate(ids, params):
            first = first or time.monotonic()
            sys.stdout.write(texts.push(out.new_token_ids))
            sys.stdout.flush()
        spec = engine.stats().spec_decode
    sys.stdout.write(texts.finish() + "\n")
    elapsed = time.monotonic() - start
    ttft = (first or start) - start
    speculated = ""
    if spec is not None:
        speculated = (
            f", {spec.num_accepted_tokens} of {spec.num_draft_tokens} proposed tokens accepted"
        )
    print(
        f"[{len(ids)} prompt tokens, {out.num_output_tokens} generated "
        f"({out.finish_reason}), first token after {ttft:.2f} s, "
        f"{out.num_output_tokens / max(elapsed, 1e-9):.1f} tokens/s{speculated}]",
        file=sys.stderr,
    )
