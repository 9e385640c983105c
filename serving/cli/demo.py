"""``hybridkv demo`` (the main job on the built-in model) and ``hybridkv bench``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import attrs

from hybridkv.serving.cli.flags.console import add_log_level_argument, configure_logging
from hybridkv.serving.cli.flags.engine import (
    add_engine_arguments,
    add_model_argument,
    engine_args,
    kv_memory_flag,
)
from hybridkv.serving.cli.flags.offload import add_offload_arguments, offload_config


def register_demo(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``hybridkv demo``."""
    parser = subparsers.add_parser(
        "demo",
        help="run a realistic workload on the built-in model and summarise it",
        description="Start the engine on a model (default: the built-in Gemma 3 270M, "
        "converted once on first use), send a support-chatbot workload (requests sharing a "
        "system prompt, some pasting documents longer than the sliding window, arriving "
        "over time, streamed), print some answers, and end with a summary table.",
    )
    add_model_argument(parser)
    work = parser.add_argument_group("workload")
    work.add_argument("--requests", type=int, default=24, metavar="N", help="requests (24)")
    work.add_argument(
        "--rate", type=float, default=4.0, metavar="R", help="mean arrivals per second (4)"
    )
    work.add_argument(
        "--max-tokens", type=int, default=32, metavar="N", help="tokens per answer (32)"
    )
    work.add_argument("--samples", type=int, default=2, metavar="N", help="answers to print (2)")
    work.add_argument("--seed", type=int, default=0, metavar="N", help="workload seed (0)")
    _add_plot_argument(parser, "the run")
    add_log_level_argument(parser, "warning")
    add_engine_arguments(parser)
    add_offload_arguments(parser)
    parser.set_defaults(handler=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    """Load, run the demo workload with a progress bar, print samples and the summary."""
    import anyio

    from hybridkv.serving.cli.loading import load_model
    from hybridkv.serving.cli.workload.report import format_table, summary_rows
    from hybridkv.serving.cli.workload.run import demo_workload

    configure_logging(args.log_level, args.log_format)
    _check_positive(args, "requests", "max_tokens", "rate")
    _check_plot(args)
    loaded = load_model(engine_args(args))
    plan = loaded.executor.plan
    print(
        f"{loaded.name}: {len(loaded.specs)} layers in {len(plan.groups)} KV groups, "
        f"{plan.num_blocks:,} pages of {plan.block_size} tokens "
        + (f"(a state page spans {plan.state_span}) " if plan.state_span > 1 else "")
        + f"(a uniform allocator would get {plan.uniform_num_blocks:,})",
        file=sys.stderr,
    )
    requests = demo_workload(
        loaded.tokenizer,
        num_requests=args.requests,
        rate_per_s=args.rate,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    prompts = {r.request_id: r.prompt_token_ids for r in requests}
    shown: set[str] = set()

    def show(record: Any, write: Any) -> None:
        # One answer per kind of request, up to --samples.
        if len(shown) >= args.samples or record.kind in shown:
            return
        shown.add(record.kind)
        question = loaded.tokenizer.decode(list(prompts[record.request_id][-24:]))
        answer = loaded.tokenizer.decode(record.output_token_ids)
        # A base model goes on to write the next turn itself; show only the answer.
        answer = " ".join(answer.split("\nCustomer:")[0].split())
        write(f"\n[{record.request_id}, {record.kind} prompt of {record.num_prompt_tokens} tokens]")
        write(f"  ...{' '.join(question.split())}")
        write(f"  -> {answer}\n")

    offload = offload_config(args, loaded.executor)
    result = anyio.run(_run_with_bar, loaded, requests, show, offload)
    weights = f"weights {loaded.weights}" + (" (machine default)" if args.weights == "auto" else "")
    print(f"\nsummary ({loaded.name}, {args.dtype}, {weights}, {_threads()} threads)")
    print("\n".join(format_table(summary_rows(result, plan, loaded.specs))))
    source = (
        f"hybridkv demo {loaded.name} --requests {args.requests} --rate {args.rate:g} "
        f"--max-tokens {args.max_tokens} --seed {args.seed} --kv-memory {kv_memory_flag(args)}"
    )
    _save_plot(args, result, plan, f"pages per KV group, hybridkv demo on {loaded.name}", source)
    return 0


async def _run_with_bar(loaded: Any, requests: Any, show: Any, offload: Any) -> Any:
    from tqdm import tqdm

    from hybridkv.scheduler import Engine
    from hybridkv.serving.cli.workload.run import run_workload

    with tqdm(total=len(requests), unit="req", desc="requests", file=sys.stderr) as bar:
        tokens = [0]

        def on_tokens(record: Any, num_new: int) -> None:
            tokens[0] += num_new
            bar.set_postfix(tokens=tokens[0], refresh=False)

        def on_finish(record: Any) -> None:
            bar.update(1)
            show(record, bar.write)

        async with Engine(
            loaded.engine_config, loaded.executor, offload=offload, proposer=loaded.proposer
        ) as engine:
            return await run_workload(engine, requests, on_tokens=on_tokens, on_finish=on_finish)


def register_bench(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``hybridkv bench``."""
    parser = subparsers.add_parser(
        "bench",
        help="measure throughput on synthetic requests, hybrid against uniform KV layout",
        description="Send fixed-length random-token requests (all at once, or at --rate) "
        "and report throughput and latency; with --compare-uniform, run the same requests "
        "again with every layer given full-attention memory in the same KV bytes.",
    )
    add_model_argument(parser)
    work = parser.add_argument_group("workload")
    work.add_argument("--requests", type=int, default=16, metavar="N", help="requests (16)")
    work.add_argument("--prompt-len", type=int, default=1024, metavar="N", help="(1024)")
    work.add_argument("--output-len", type=int, default=32, metavar="N", help="(32)")
    work.add_argument(
        "--shared-prefix", type=int, default=0, metavar="N", help="tokens shared by all (0)"
    )
    work.add_argument("--rate", type=float, default=None, help="arrivals/s (all at once)")
    work.add_argument(
        "--compare-uniform", action="store_true", help="also run with the uniform layout"
    )
    _add_plot_argument(parser, "the hybrid layout's run")
    add_log_level_argument(parser, "warning")
    add_engine_arguments(parser, kv_memory="256MiB")
    add_offload_arguments(parser)
    parser.set_defaults(handler=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    """Run the synthetic workload once per layout and print one row each."""
    import anyio

    from hybridkv.serving.cli.loading import load_model
    from hybridkv.serving.cli.workload.run import run_workload, synthetic_workload

    configure_logging(args.log_level, args.log_format)
    _check_positive(args, "requests", "prompt_len", "output_len")
    if args.rate is not None:  # None sends every request at once
        _check_positive(args, "rate")
    if not 0 <= args.shared_prefix <= args.prompt_len:
        from hybridkv.serving.cli.flags.values import UsageError

        raise UsageError(f"--shared-prefix must be in [0, --prompt-len], got {args.shared_prefix}")
    _check_plot(args)
    base = engine_args(args)
    rows = []
    for uniform in (False, True) if args.compare_uniform else (False,):
        loaded = load_model(attrs.evolve(base, uniform_kv=uniform), quiet=True)
        requests = synthetic_workload(
            num_requests=args.requests,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            shared_prefix_len=args.shared_prefix,
            vocab_size=loaded.engine_config.vocab_size or 32000,
            rate_per_s=args.rate,
        )

        async def run(loaded: Any = loaded, requests: Any = requests) -> Any:
            from hybridkv.scheduler import Engine

            async with Engine(
                loaded.engine_config,
                loaded.executor,
                offload=offload_config(args, loaded.executor),
                proposer=loaded.proposer,
            ) as engine:
                return await run_workload(engine, requests)

        result = anyio.run(run)
        rows.append(_bench_row("uniform" if uniform else "hybrid", loaded, result))
        print(_format_row(rows[-1]), file=sys.stderr)
        if not uniform:  # the run --plot draws
            hybrid_result, hybrid_loaded = result, loaded
    print(_format_rows(rows))
    result, loaded = hybrid_result, hybrid_loaded
    source = (
        f"hybridkv bench {loaded.name} --requests {args.requests} "
        f"--prompt-len {args.prompt_len} --output-len {args.output_len} "
        f"--shared-prefix {args.shared_prefix} --kv-memory {kv_memory_flag(args)}"
        + ("" if args.rate is None else f" --rate {args.rate:g}")
    )
    title = f"pages per KV group, hybridkv bench on {loaded.name}"
    _save_plot(args, result, loaded.executor.plan, title, source)
    return 0


def _add_plot_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"save the pages each KV group holds over {what}, one sample per engine step, "
        "as a PNG line chart at FILE and its series beside it (FILE with .json); needs the "
        "bench extra (matplotlib)",
    )


def _check_plot(args: argparse.Namespace) -> None:
    """Before loading anything: the --plot folder exists and matplotlib imports."""
    if args.plot is not None:
        from hybridkv.serving.cli.workload.plots import check_plot_path, require_matplotlib

        check_plot_path(args.plot)
        require_matplotlib()


def _save_plot(args: argparse.Namespace, result: Any, plan: Any, title: str, source: str) -> None:
    if args.plot is None:
        return
    from hybridkv.serving.cli.workload.plots import pages_series, save_pages_plot

    series = pages_series(result.pages, plan, title=title, source=source)
    png, data = save_pages_plot(args.plot, series)
    print(f"pages per group: {png} (series: {data})", file=sys.stderr)


def _bench_row(layout: str, loaded: Any, result: Any) -> dict[str, str]:
    import statistics

    records = result.records
    output = sum(r.num_output_tokens for r in records)
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    return {
        "layout": layout,
        "pages": f"{loaded.engine_config.num_blocks:,}",
        "wall s": f"{result.elapsed_s:.1f}",
        "output tok/s": f"{output / max(result.elapsed_s, 1e-9):.1f}",
        "median TTFT s": f"{statistics.median(ttfts):.2f}" if ttfts else "-",
        "peak pages": f"{sum(result.peak_blocks_per_group):,}",
        "preemptions": str(result.num_preemptions),
    }


def _format_row(row: dict[str, str]) -> str:
    return "  ".join(f"{k}={v}" for k, v in row.items())


def _format_rows(rows: list[dict[str, str]]) -> str:
    keys = list(rows[0])
    widths = [max(len(k), *(len(r[k]) for r in rows)) for k in keys]
    lines = ["  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True))]
    lines += ["  ".join(r[k].ljust(w) for k, w in zip(keys, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _check_positive(args: argparse.Namespace, *names: str) -> None:
    from hybridkv.serving.cli.flags.values import UsageError

    for name in names:
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")


def _threads() -> int:
    import torch

    return torch.get_num_threads()
