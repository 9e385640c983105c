"""Speculative decoding with n-gram prompt lookup against plain decoding, on the built-in model.

The built-in Gemma 3 270M (``--weights``, the machine's default; ``--threads`` 2) serves
greedy requests (temperature 0, at most ``--max-tokens`` each, ending at the model's end
of turn) through the async :class:`Engine`, a fresh engine for every run. Three
workloads, whose prompts are in ``prompts.py``:

  copy            chat turns whose reply copies the prompt: repeat a passage, correct its
                  spelling, add a docstring to a function, rename a parameter, rewrite a
                  letter with another name
  free            open-ended text: the opening of a story to continue (the built-in
                  model continues text; its GGUF has no chat template)
  free-penalised  the same openings with ``repetition_penalty`` 1.3, still greedy: text
                  that does not repeat itself, where a prompt lookup finds little

each at batch 1 (``--batch1-prompts`` requests one after another) and at batch 8 (eight
requests at once), once without speculation (``off``) and once per ``k`` of ``--k`` (2 and
3) with ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min":
--lookup-min, "prompt_lookup_max": --lookup-max}``, the engine's default ``adaptive``
included (it proposes in a step only where its measured rate says proposals pay); with
``--fixed``, each ``k`` also with ``"adaptive": false`` (proposals in every step). A round
runs every variant of every cell (a workload at a batch size), the variants in an order
rotated by one each round; ``--rounds`` rounds. Per cell and variant:

  out tok/s      output tokens over the run's wall time (first request in to last token)
  ratio          out tok/s over ``off``'s of the same cell in the same round: the median
                 over rounds, and their spread (min-max)
  ITL ms         per request, the time from its first token to its last over the tokens
                 after the first; the median over requests, then over rounds
  accept         accepted over proposed tokens (the engine's ``spec_decode`` counts)
  tokens/step    output tokens per engine step (prefill steps included)
  identical      every request's greedy tokens equal ``off``'s in the same round
  repeats        (``off`` rows) the share of the output's 4-grams of tokens that occurred
                 before, in the prompt or earlier in the output: what a lookup can find

The machine is shared: CPU time used by other processes during a run is measured
(``/proc/stat`` less this process and its server), and a cell's round where others used
more than ``--quiet-below`` cores is run again once they stop (up to ``--max-wait``
seconds of waiting); what others used is in the JSON.

With ``--llama-server`` (``llama_cpp.py``), llama.cpp's ``llama-server`` (built by
``peers/llama_peers.py``) serves the GGUF file the built-in model is made from, one
slot, ``--threads`` threads, without and with its own prompt lookup (``--spec-type
ngram-simple`` for each ``k`` of ``--llama-k``, 3: the last ``min(k, --lookup-max)``
tokens looked up, the ``k`` tokens after the latest match proposed), on the same prompts
(token ids) at batch 1 (``--llama-workloads``, copy and free), greedy ``/completion``
without prompt caching, a server started per variant and round; its ITL is the server's
``predicted_ms`` over ``predicted_n``.

    python -m benchmarks.speculative.run [--k 2 3] [--fixed] [--rounds 3] [--llama-server]
                                     [--json FILE]

The last line printed is one JSON object; ``--json FILE`` writes it with the command.
The records and the report are in ``report.py``, what else uses the machine in
``machine.py``.
Results: docs/benchmarks.md, section "Speculative decoding (n-gram prompt lookup)".
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import time
from typing import Any

import anyio
import attrs
import structlog
import torch

from benchmarks.common.results import add_json_argument, write_json
from benchmarks.speculative.llama_cpp import llama
from benchmarks.speculative.machine import cpu_sample, foreign_cores, measured
from benchmarks.speculative.prompts import WORKLOADS, Workload, prompt_ids
from benchmarks.speculative.report import Cell, Run, Variant, print_table, summarise
from hybridkv.scheduler import Engine, EngineConfig, SamplingParams
from hybridkv.scheduler.speculation import SpeculativeConfig
from hybridkv.serving.cli.loading import EngineArgs, LoadedModel, load_model

# -- hybridkv ----------------------------------------------------------------------------


def greedy(max_tokens: int, workload: Workload) -> SamplingParams:
    """Temperature 0, with the workload's repetition penalty."""
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, repetition_penalty=workload.repetition_penalty
    )


async def _serve(
    config: EngineConfig,
    model: LoadedModel,
    prompts: list[list[int]],
    batch: int,
    params: SamplingParams,
) -> Run:
    outputs: list[list[int]] = [[] for _ in prompts]
    itls: list[float] = [0.0] * len(prompts)
    limiter = anyio.CapacityLimiter(batch)

    async def one(index: int) -> None:
        async with limiter:
            first = last = 0.0
            async with engine.generate(prompts[index], params) as stream:
                async for output in stream:
                    last = time.perf_counter()
                    if not outputs[index]:
                        first = last
                    outputs[index].extend(output.new_token_ids)
            itls[index] = (last - first) / max(1, len(outputs[index]) - 1)

    async with Engine(config, model.executor) as engine:
        before = cpu_sample()
        async with anyio.create_task_group() as group:
            for index in range(len(prompts)):
                group.start_soon(one, index)
        after = cpu_sample()
        stats = engine.stats()
    seconds = after.wall - before.wall
    return Run(
        seconds, outputs, itls, stats.num_steps, stats.spec_decode, foreign_cores(before, after)
    )


def serve(
    model: LoadedModel,
    variant: Variant,
    prompts: list[list[int]],
    batch: int,
    params: SamplingParams,
) -> Run:
    """Requests for ``prompts``, ``batch`` at a time, through a fresh engine."""
    config = attrs.evolve(model.engine_config, speculative_config=variant.spec)
    run: Run = anyio.run(_serve, config, model, prompts, batch, params)
    return run


def run_cell(
    model: LoadedModel, order: list[Variant], cell: Cell, label: str
) -> tuple[dict[str, Run], float]:
    """One run of each variant of ``cell``, in ``order``; the most cores others used."""
    runs = {}
    for variant in order:
        run = serve(model, variant, cell.prompts, cell.batch, cell.params)
        runs[variant.name] = run
        accept = f", accept {run.spec.acceptance_rate:.2f}" if run.spec else ""
        print(
            f"{label} {variant.name:4s}: {run.tok_s:6.1f} out tok/s, {run.output_tokens} "
            f"tokens, {run.steps} steps{accept}, others {run.foreign_cores:.2f} cores",
            flush=True,
        )
    return runs, max(run.foreign_cores for run in runs.values())


def ours(
    model: LoadedModel, variants: list[Variant], args: argparse.Namespace, redone: list[str]
) -> list[Cell]:
    """Every cell's runs, ``--rounds`` rounds, the variants rotated a place each round."""
    cells = []
    for name in args.workloads:
        workload = WORKLOADS[name]
        prompts = prompt_ids(model, workload)
        params = greedy(args.max_tokens, workload)
        for batch in args.batch:
            count = args.batch1_prompts if batch == 1 else max(batch, len(prompts))
            chosen = [prompts[i % len(prompts)] for i in range(count)]
            cells.append(Cell(name, batch, chosen, params, {v.name: [] for v in variants}))
    # Untimed: the first steps of each shape pay allocations and page faults.
    warm = prompt_ids(model, WORKLOADS["copy"])
    for variant in variants:
        for batch in args.batch:
            serve(model, variant, warm[:batch], batch, greedy(16, WORKLOADS["copy"]))
    deadline = time.monotonic() + args.max_wait
    for round_ in range(args.rounds):
        shift = round_ % len(variants)
        order = variants[shift:] + variants[:shift]
        for cell in cells:
            label = f"round {round_ + 1} {cell.workload} batch {cell.batch}"

            attempt = functools.partial(run_cell, model, order, cell, label)
            for name, run in measured(args, label, deadline, redone, attempt).items():
                cell.runs[name].append(run)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="auto", help="hybridkv's --weights (auto)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 3])
    parser.add_argument(
        "--fixed",
        action="store_true",
        help="also each k with adaptive false (proposals in every step)",
    )
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=3)
    parser.add_argument(
        "--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS), metavar="NAME"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--batch1-prompts", type=int, default=3, help="requests at batch 1 (3)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--quiet-below",
        type=float,
        default=0.2,
        metavar="CORES",
        help="run a cell's round again where other processes used this many cores (0.2)",
    )
    parser.add_argument(
        "--max-wait", type=float, default=1800, help="most seconds to wait for quiet, per part"
    )
    parser.add_argument(
        "--llama-server", action="store_true", help="also run llama-server (llama_peers.py)"
    )
    parser.add_argument("--llama-k", type=int, nargs="+", default=[3], help="(3)")
    parser.add_argument(
        "--llama-workloads",
        nargs="+",
        default=["copy", "free"],
        choices=list(WORKLOADS),
        metavar="NAME",
        help="(copy free)",
    )
    add_json_argument(parser)
    args = parser.parse_args()
    # The library never configures logging; this script silences per-step events.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    started_at = time.perf_counter()
    settings = EngineArgs(
        model="gemma-3-270m", weights=args.weights, threads=args.threads, kv_memory=512 << 20
    )
    model = load_model(settings, quiet=True)
    variants = [Variant("off")] + [
        Variant(
            f"k={k}" + ("" if adaptive else " fixed"),
            SpeculativeConfig(
                method="ngram",
                num_speculative_tokens=k,
                prompt_lookup_min=args.lookup_min,
                prompt_lookup_max=args.lookup_max,
                adaptive=adaptive,
            ),
        )
        for adaptive in ([True, False] if args.fixed else [True])
        for k in args.k
    ]
    redone: list[str] = []
    cells = ours(model, variants, args, redone)
    rows = [row for cell in cells for row in summarise(cell, variants, model)]
    model.executor.close()  # its OpenMP team would slow llama-server down
    results: dict[str, Any] = {
        "model": model.name,
        "weights": model.weights,
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "batch1_prompts": args.batch1_prompts,
        "lookup_min": args.lookup_min,
        "lookup_max": args.lookup_max,
        "adaptive": [True, False] if args.fixed else [True],
        "quiet_below_cores": args.quiet_below,
        "rows": rows,
    }
    if args.llama_server:
        results["llama_server"] = llama(model, args.llama_k, args, redone)
    else:
        results["llama_server"] = {"ran": False, "reason": "not asked for (--llama-server)"}
    results["redone"] = redone
    results["seconds"] = time.perf_counter() - started_at
    print_table(rows, f"hybridkv, {model.weights} weights, {args.threads} threads")
    if results["llama_server"]["ran"]:
        print_table(results["llama_server"]["rows"], f"llama-server, {args.threads} threads")
    else:
        print(f"\nllama-server: not run ({results['llama_server']['reason']})", file=sys.stderr)
    print(f"\n{results['seconds']:.0f} s in all, {len(redone)} rounds of a cell run again")
    print(json.dumps(results))
    write_json(args.json, results)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
