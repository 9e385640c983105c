"""llama.cpp's ``llama-server`` without and with its own prompt lookup, on the speculative
benchmark's prompts (``run.py --llama-server``)."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.peers.vs_llama_cpp import running
from benchmarks.speculative.machine import cpu_sample, foreign_cores, measured
from benchmarks.speculative.prompts import WORKLOADS, prompt_ids
from benchmarks.speculative.report import _tok_s, spread
from hybridkv.serving.cli.loading import LoadedModel

LLAMA_PORT = 18331
LLAMA_CONTEXT = 4096

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
    import benchmarks.peers.llama_peers as llama_peers
    from benchmarks.peers.vs_llama_cpp import gguf_file

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
