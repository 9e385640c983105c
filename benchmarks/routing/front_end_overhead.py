"""What a front end adds to the time to first token: ours (``hybridkv route``) against
SGLang's model gateway (``smg``), over the same replica, side by side.

One ``hybridkv serve`` replica of a tiny random model; ``hybridkv route`` and ``smg``
(``cache_aware``) both in front of it. Each round sends ``--concurrency`` streamed
completions at once to the replica directly, through ours and through smg in turn (so
all three see the same machine load), every prompt new (no prefix hit anywhere). For
each path:

    ttft ms         time from sending to the first streamed token (a round's mean),
                    median (q1-q3) over the rounds
    added ms        the path's TTFT less the direct one's of the same round, median
    vs smg          our added time over smg's, per round: median (q1-q3)
    CPU ms          the front end's CPU time (user and system) over the run, per request
                    it forwarded (its probes and polls between included)

    python -m benchmarks.routing.front_end_overhead [--rounds 200] [--prompt-tokens 512]
                                            [--concurrency 1] [--max-tokens 2]
                                            [--route-args="--loop asyncio"]

``smg`` is installed by the benchmark into ``~/.cache/hybridkv-peers/`` (see
``routing/real.py``); without it only ours and the direct path are measured. The last
line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common.results import add_json_argument, write_json
from benchmarks.routing.real import (
    _start,
    _start_smg,
    _stop,
    cpu_seconds,
    save_model,
    smg_binary,
)


async def _ttft(client: Any, url: str, model: str, prompt: str, max_tokens: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True}  # fmt: skip
    sent = time.perf_counter()
    first: float | None = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{url} streamed no token")
    return 1000 * (first - sent)


async def _measure(paths: dict[str, str], args: argparse.Namespace) -> dict[str, list[float]]:
    import httpx

    rng = random.Random(0)
    times: dict[str, list[float]] = {name: [] for name in paths}
    async with httpx.AsyncClient(timeout=120.0) as client:
        direct = paths["direct"]
        model = (await client.get(f"{direct}/v1/models")).json()["data"][0]["id"]
        for round_index in range(args.warmup + args.rounds):
            order = list(paths.items())
            rng.shuffle(order)
            for name, url in order:
                prompts = [
                    "".join(chr(rng.randrange(97, 123)) for _ in range(args.prompt_tokens))
                    for _ in range(args.concurrency)
                ]
                ttfts = await asyncio.gather(
                    *(_ttft(client, url, model, p, args.max_tokens) for p in prompts)
                )
                if round_index >= args.warmup:
                    times[name].append(statistics.mean(ttfts))
    return times


def _spread(values: list[float]) -> dict[str, float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return {"median": median, "q1": q1, "q3": q3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=2, help="tokens each answer streams (2)")
    parser.add_argument(
        "--concurrency", type=int, default=1, help="requests sent at once per round and path"
    )
    parser.add_argument("--no-smg", action="store_true", help="measure ours alone")
    parser.add_argument(
        "--route-args",
        default="",
        metavar="ARGS",
        help='more flags for hybridkv route (quoted: --route-args="--loop asyncio")',
    )
    add_json_argument(parser)
    args = parser.parse_args()
    processes = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_model("full", Path(tmp) / "model")
        try:
            replica, direct = _start(
                ["serve", str(folder), "--port", "0", "--threads", "1", "--kv-memory", "64MiB",
                 "--block-size", "16", "--log-level", "warning", "--disable-log-stats"],
                "serving ",
            )  # fmt: skip
            processes.append(replica)
            ours, ours_url = _start(
                ["route", str(folder), "--replica", direct, "--port", "0",
                 "--log-level", "warning", *args.route_args.split()],
                "routing at ",
            )  # fmt: skip
            processes.append(ours)
            paths = {"direct": direct, "ours": ours_url}
            pids = {"ours": ours.pid}
            if not args.no_smg and smg_binary() is not None:
                smg, paths["smg"] = _start_smg([direct])
                processes.append(smg)
                pids["smg"] = smg.pid
            before = {name: cpu_seconds(pid) for name, pid in pids.items()}
            times = asyncio.run(_measure(paths, args))
            cpu_s = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
        finally:
            _stop(processes)
    added = {
        name: [t - d for t, d in zip(values, times["direct"], strict=True)]
        for name, values in times.items()
        if name != "direct"
    }
    out: dict[str, Any] = {
        "rounds": args.rounds,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "route_args": args.route_args,
        "ttft_ms": {name: _spread(values) for name, values in times.items()},
        "added_ms": {name: _spread(values) for name, values in added.items()},
    }
    requests = (args.warmup + args.rounds) * args.concurrency
    out["cpu_ms_per_request"] = {name: 1000 * s / requests for name, s in cpu_s.items()}
    if "smg" in times:
        ratio = [o / s for o, s in zip(times["ours"], times["smg"], strict=True)]
        out["ours_over_smg_ttft"] = _spread(ratio)
    print(f"{'path':8} {'ttft ms':>22} {'added ms':>22}")
    for name, spread in out["ttft_ms"].items():
        cell = "{median:.2f} ({q1:.2f}-{q3:.2f})".format(**spread)
        extra = out["added_ms"].get(name)
        more = "{median:.2f} ({q1:.2f}-{q3:.2f})".format(**extra) if extra else ""
        print(f"{name:8} {cell:>22} {more:>22}")
    cpu = ", ".join(f"{name} {ms:.2f}" for name, ms in out["cpu_ms_per_request"].items())
    print(f"front end CPU ms per request: {cpu}")
    if "ours_over_smg_ttft" in out:
        print(
            "ours / smg TTFT: {median:.3f} ({q1:.3f}-{q3:.3f})".format(**out["ours_over_smg_ttft"])
        )
    write_json(args.json, out)
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
