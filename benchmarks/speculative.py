"""Speculative decoding with n-gram prompt lookup against plain decoding, on the built-in model.

The built-in Gemma 3 270M (``--weights``, the machine's default; ``--threads`` 2) serves
greedy requests (temperature 0, at most ``--max-tokens`` each, ending at the model's end
of turn) through the async :class:`Engine`, a fresh engine for every run. Three
workloads, whose prompts are kept in this file:

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

With ``--llama-server``, llama.cpp's ``llama-server`` (built by ``llama_peers.py``) serves
the GGUF file the built-in model is made from, one slot, ``--threads`` threads, without
and with its own prompt lookup (``--spec-type ngram-simple`` for each ``k`` of
``--llama-k``, 3: the last ``min(k, --lookup-max)`` tokens looked up, the ``k`` tokens
after the latest match proposed), on
the same prompts (token ids) at batch 1 (``--llama-workloads``, copy and free), greedy
``/completion`` without prompt caching, a server started per variant and round; its ITL
is the server's ``predicted_ms`` over ``predicted_n``.

    python benchmarks/speculative.py [--k 2 3] [--fixed] [--rounds 3] [--llama-server]
                                     [--json FILE]

The last line printed is one JSON object; ``--json FILE`` writes it with the command.
Results: docs/benchmarks.md, section "Speculative decoding (n-gram prompt lookup)".
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio
import attrs
import structlog
import torch
from _results import add_json_argument, write_json
from _speculative_prompts import WORKLOADS, Workload
from vs_llama_cpp import running

from hybridkv.scheduler import Engine, EngineConfig, SamplingParams
from hybridkv.scheduler.outputs import SpecDecodeStats
from hybridkv.scheduler.speculation import SpeculativeConfig
from hybridkv.serving.cli.loading import EngineArgs, LoadedModel, load_model

LLAMA_PORT = 18331
LLAMA_CONTEXT = 4096
T = TypeVar("T")


@attrs.frozen
class Variant:
    """Plain decoding (``spec`` None) or n-gram speculation of ``k`` tokens."""

    name: str
    spec: SpeculativeConfig | None = None

    @property
    def k(self) -> int:
        return self.spec.num_speculative_tokens if self.spec else 0


@attrs.define
class Run:
    """One variant of one cell in one round."""

    seconds: float
    outputs: list[list[int]]
    itls: list[float]  # per request: seconds per token after its first
    steps: int
    spec: SpecDecodeStats | None
    foreign_cores: float = 0.0

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


@attrs.define
class Cell:
    """A workload at a batch size: its prompts, and its runs per variant round by round."""

    workload: str
    batch: int
    prompts: list[list[int]]
    params: SamplingParams
    runs: dict[str, list[Run]] = attrs.field(factory=dict)


# -- what else uses the machine ----------------------------------------------------------


@attrs.frozen
class CpuSample:
    wall: float
    busy: float  # CPU seconds the machine has been busy
    own: float  # CPU seconds of this process and the processes it watches


def _process_cpu(pid: int) -> float:
    """CPU seconds (user and system) process ``pid`` has used; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_sample(watched: Sequence[int] = ()) -> CpuSample:
    """The machine's busy CPU seconds, and this process's (with ``watched``'s)."""
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:9]]
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait
    own = sum(os.times()[:2]) + sum(_process_cpu(pid) for pid in watched)
    return CpuSample(time.perf_counter(), busy, own)


def foreign_cores(begin: CpuSample, end: CpuSample) -> float:
    """Cores other processes kept busy, on average, between two samples."""
    other = (end.busy - begin.busy) - (end.own - begin.own)
    return max(0.0, other) / max(1e-9, end.wall - begin.wall)


def wait_quiet(args: argparse.Namespace, deadline: float) -> None:
    """Return once other processes use under ``--quiet-below`` cores over 5 s (or at
    ``deadline``, the end of the waiting allowed)."""
    while time.monotonic() < deadline:
        begin = cpu_sample()
        time.sleep(5)
        used = foreign_cores(begin, cpu_sample())
        if used < args.quiet_below:
            return
        print(f"  waiting: other processes use {used:.2f} cores", flush=True)


def measured(
    args: argparse.Namespace,
    label: str,
    deadline: float,
    redone: list[str],
    attempt: Callable[[], tuple[T, float]],
) -> T:
    """``attempt``'s result (it returns the most cores others used in any of its runs),
    made on a quiet machine: made again while others used too much and waiting is still
    allowed; ``label`` is added to ``redone`` for each attempt thrown away."""
    while True:
        wait_quiet(args, deadline)
        result, used = attempt()
        if used < args.quiet_below or time.monotonic() >= deadline:
            return result
        print(f"  {label}: other processes used {used:.2f} cores; again", flush=True)
        redone.append(label)


# -- hybridkv ----------------------------------------------------------------------------


def greedy(max_tokens: int, workload: Workload) -> SamplingParams:
    """Temperature 0, with the workload's repetition penalty."""
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, repetition_penalty=workload.repetition_penalty
    )


def prompt_ids(model: LoadedModel, workload: Workload) -> list[list[int]]:
    """The workload's prompts as token ids: a chat turn in the model's template (which
    writes BOS itself), or the text after BOS."""
    prompts = []
    for text in workload.texts:
        if workload.chat:
            rendered = model.chat_template.render([{"role": "user", "content": text}])
            ids = model.tokenizer.encode(rendered, add_special_tokens=False).ids
        else:
            ids = model.tokenizer.encode(text, add_special_tokens=True).ids
        prompts.append(list(ids))
    return prompts


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


def copied_share(prompt: list[int], output: list[int], n: int = 4) -> float:
    """The share of ``output``'s ``n``-grams that occur in ``prompt``."""
    grams = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    mine = [tuple(output[i : i + n]) for i in range(len(output) - n + 1)]
    return sum(g in grams for g in mine) / len(mine) if mine else 0.0


def repeated_share(prompt: list[int], output: list[int], n: int = 4) -> float:
    """The share of ``output``'s ``n``-grams that occurred before, in the prompt or
    earlier in the output: what a prompt lookup can find."""
    tokens = prompt + output
    seen = {tuple(tokens[i : i + n]) for i in range(len(prompt) - n + 1)}
    starts = range(max(0, len(prompt) - n + 1), len(tokens) - n + 1)
    found = 0
    for i in starts:  # the n-grams that end in the output
        gram = tuple(tokens[i : i + n])
        found += gram in seen
        seen.add(gram)
    return found / len(starts) if starts else 0.0


def first_difference(ours: Sequence[int], theirs: Sequence[int]) -> int:
    """The first position where the token lists differ (the shorter length if one is a
    prefix of the other)."""
    for position, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return position
    return min(len(ours), len(theirs))


def differences(runs: list[Run], base: list[Run], model: LoadedModel) -> list[dict[str, Any]]:
    """Every request whose tokens in ``runs`` differ from ``base``'s in the same round:
    where, and the text around the first difference."""
    found = []
    for round_, (run, off) in enumerate(zip(runs, base, strict=True)):
        for index, (ours, theirs) in enumerate(zip(run.outputs, off.outputs, strict=True)):
            if ours != theirs:
                at = first_difference(ours, theirs)
                window = slice(max(0, at - 8), at + 8)
                found.append(
                    {
                        "round": round_,
                        "prompt": index,
                        "position": at,
                        "speculative": model.tokenizer.decode(ours[window]),
                        "off": model.tokenizer.decode(theirs[window]),
                    }
                )
    return found


def spread(values: list[float]) -> dict[str, Any]:
    """The median of ``values`` (a ratio per round), their min and max, and themselves."""
    return {
        "ratio": statistics.median(values),
        "ratio_min": min(values),
        "ratio_max": max(values),
        "ratios": values,
    }


def summarise(cell: Cell, variants: list[Variant], model: LoadedModel) -> list[dict[str, Any]]:
    """One row per variant of ``cell``: medians over rounds, ratios to the same round's
    ``off``, acceptance, and whether the greedy tokens equal ``off``'s."""
    base = cell.runs["off"]
    rows = []
    for variant in variants:
        runs = cell.runs[variant.name]
        row: dict[str, Any] = {
            "workload": cell.workload,
            "batch": cell.batch,
            "variant": variant.name,
            "k": variant.k,
            "requests": len(cell.prompts),
            "output_tokens": statistics.median(run.output_tokens for run in runs),
            "out_tok_s": statistics.median(run.tok_s for run in runs),
            **spread([run.tok_s / off.tok_s for run, off in zip(runs, base, strict=True)]),
            "itl_ms": statistics.median(statistics.median(run.itls) * 1e3 for run in runs),
            "ms_per_step": statistics.median(run.seconds / run.steps * 1e3 for run in runs),
            "tokens_per_step": statistics.median(run.output_tokens / run.steps for run in runs),
            "rounds_out_tok_s": [run.tok_s for run in runs],
            "foreign_cores": [run.foreign_cores for run in runs],
        }
        if variant.spec is None:
            pairs = list(zip(cell.prompts, base[0].outputs, strict=True))
            row["copied_4grams"] = statistics.mean(copied_share(p, o) for p, o in pairs)
            row["repeated_4grams"] = statistics.mean(repeated_share(p, o) for p, o in pairs)
        else:
            counts = [run.spec for run in runs if run.spec is not None]
            drafts = sum(c.num_drafts for c in counts)
            proposed = sum(c.num_draft_tokens for c in counts)
            accepted = sum(c.num_accepted_tokens for c in counts)
            mismatches = differences(runs, base, model)
            row |= {
                "lookup_min": variant.spec.prompt_lookup_min,
                "lookup_max": variant.spec.prompt_lookup_max,
                "drafts": drafts,
                "draft_tokens": proposed,
                "accepted_tokens": accepted,
                "acceptance_rate": accepted / proposed if proposed else None,
                "accepted_per_draft": accepted / drafts if drafts else None,
                "identical": not mismatches,
                "mismatches": mismatches,
            }
        rows.append(row)
    return rows


# -- llama-server ------------------------------------------------------------------------


def llama_command(
    server: Path, gguf: Path, args: argparse.Namespace, port: int, k: int
) -> list[str]:
    """llama-server on ``gguf``, one slot; with ``k`` > 0 its prompt lookup proposing
    ``k`` tokens after a match of the last ``min(k, --lookup-max)`` (ngram-simple proposes
    nothing where the looked-up n-gram is longer than the draft)."""
    command = [str(server), "-m", str(gguf), "--port", str(port), "-t", str(args.threads),
               "-np", "1", "-c", str(LLAMA_CONTEXT), "--log-disable"]  # fmt: skip
    if k:
        command += ["--spec-type", "ngram-simple",
                    "--spec-ngram-simple-size-n", str(min(args.lookup_max, k)),
                    "--spec-ngram-simple-size-m", str(k), "--spec-draft-n-max", str(k)]  # fmt: skip
    return command


def llama_complete(
    port: int, prompt: list[int], max_tokens: int, repetition_penalty: float = 1.0
) -> dict[str, Any]:
    """One greedy ``/completion`` of token ids, not from the prompt cache (a repetition
    penalty, where given, over the whole context as the engine's)."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "n_predict": max_tokens,
        "temperature": 0.0,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }
    if repetition_penalty != 1.0:
        body |= {"repeat_penalty": repetition_penalty, "repeat_last_n": LLAMA_CONTEXT}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as reply:
            answer: dict[str, Any] = json.loads(reply.read())
    except urllib.error.HTTPError as error:
        raise RuntimeError(f"llama-server: {error.code} {error.read()[:500]!r}") from None
    return answer


def llama(
    model: LoadedModel, ks: list[int], args: argparse.Namespace, redone: list[str]
) -> dict[str, Any]:
    """llama-server without and with its prompt lookup, batch 1, every round; or why not."""
    import llama_peers
    from vs_llama_cpp import gguf_file

    server = llama_peers.llama_server()
    if server is None:
        return {"ran": False, "reason": "llama-server is not built (run llama_peers.py first)"}
    gguf = gguf_file()
    names = ["off", *(f"k={k}" for k in ks)]
    prompts = {
        name: prompt_ids(model, WORKLOADS[name])[: args.batch1_prompts]
        for name in args.llama_workloads
    }
    warm = prompt_ids(model, WORKLOADS["copy"])[0]
    # runs[workload][variant]: per round, (seconds, answers, foreign cores)
    runs: dict[str, dict[str, list[tuple[float, list[dict[str, Any]], float]]]] = {
        w: {n: [] for n in names} for w in prompts
    }
    deadline = time.monotonic() + args.max_wait
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            shift = round_ % len(names)
            order = names[shift:] + names[:shift]
            label = f"round {round_ + 1} llama-server"

            def attempt(
                order: list[str] = order, label: str = label
            ) -> tuple[dict[tuple[str, str], tuple[float, list[dict[str, Any]], float]], float]:
                done = {}
                for name in order:
                    k = 0 if name == "off" else int(name.removeprefix("k="))
                    command = llama_command(server, gguf, args, LLAMA_PORT, k)
                    with running(
                        command, LLAMA_PORT, Path(scratch) / f"{name}.log", 300
                    ) as process:
                        llama_complete(LLAMA_PORT, warm, 16)  # untimed
                        for workload, chosen in prompts.items():
                            penalty = WORKLOADS[workload].repetition_penalty
                            before = cpu_sample([process.pid])
                            answers = [
                                llama_complete(LLAMA_PORT, p, args.max_tokens, penalty)
                                for p in chosen
                            ]
                            after = cpu_sample([process.pid])
                            used = foreign_cores(before, after)
                            seconds = after.wall - before.wall
                            done[(workload, name)] = (seconds, answers, used)
                            tokens = sum(a["timings"]["predicted_n"] for a in answers)
                            print(
                                f"{label} {workload} batch 1 {name:4s}: "
                                f"{tokens / seconds:6.1f} out tok/s, {tokens} tokens, "
                                f"others {used:.2f} cores",
                                flush=True,
                            )
                return done, max(run[2] for run in done.values())

            for (workload, name), run in measured(args, label, deadline, redone, attempt).items():
                runs[workload][name].append(run)
    rows = []
    for workload, by_name in runs.items():
        base_tok_s = [_tok_s(run) for run in by_name["off"]]
        for name in names:
            mine = by_name[name]
            tok_s = [_tok_s(run) for run in mine]
            answers = [a for run in mine for a in run[1]]
            proposed = sum(a["timings"].get("draft_n", 0) for a in answers)
            accepted = sum(a["timings"].get("draft_n_accepted", 0) for a in answers)
            same = all(
                a.get("tokens", a["content"]) == b.get("tokens", b["content"])
                for run, off in zip(mine, by_name["off"], strict=True)
                for a, b in zip(run[1], off[1], strict=True)
            )
            itls = [
                statistics.median(
                    a["timings"]["predicted_ms"] / max(1, a["timings"]["predicted_n"])
                    for a in run[1]
                )
                for run in mine
            ]
            rows.append(
                {
                    "workload": workload,
                    "batch": 1,
                    "variant": name,
                    "requests": len(prompts[workload]),
                    "output_tokens": statistics.median(
                        sum(a["timings"]["predicted_n"] for a in run[1]) for run in mine
                    ),
                    "out_tok_s": statistics.median(tok_s),
                    **spread([a / b for a, b in zip(tok_s, base_tok_s, strict=True)]),
                    "itl_ms": statistics.median(itls),
                    "rounds_out_tok_s": tok_s,
                    "foreign_cores": [run[2] for run in mine],
                    "draft_tokens": proposed,
                    "accepted_tokens": accepted,
                    "acceptance_rate": accepted / proposed if proposed else None,
                    "identical": same,
                }
            )
    flags = llama_command(Path("llama-server"), Path(gguf.name), args, LLAMA_PORT, max(ks))
    return {"ran": True, "server_flags": flags[1:], "rows": rows}


def _tok_s(run: tuple[float, list[dict[str, Any]], float]) -> float:
    tokens: int = sum(a["timings"]["predicted_n"] for a in run[1])
    return tokens / run[0]


# -- the report --------------------------------------------------------------------------


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    print(f"\n{title}\n")
    print(
        "| workload | batch | variant | out tok/s | ratio to off: median (min-max) | ITL ms "
        "| accept | tokens/step | identical |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        ratio = f"{row['ratio']:.2f} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})"
        accept, same = "-", "-"
        if row["variant"] != "off":
            rate = row.get("acceptance_rate")
            accept = "-" if rate is None else f"{rate:.2f}"
            same = "yes" if row["identical"] else "NO"
        elif "repeated_4grams" in row:
            accept = f"(repeats {row['repeated_4grams']:.2f})"
        per_step = f"{row['tokens_per_step']:.2f}" if "tokens_per_step" in row else "-"
        print(
            f"| {row['workload']} | {row['batch']} | {row['variant']} | {row['out_tok_s']:.1f} "
            f"| {ratio} | {row['itl_ms']:.1f} | {accept} | {per_step} | {same} |"
        )


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
