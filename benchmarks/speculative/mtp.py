"""Speculative method mtp: speed against plain decoding on this CPU, and prefix hits
with MTP on against vLLM 0.34's.

1. **Speed.** The model is a Qwen3.5-shaped hybrid made for it
   (``hybridkv.testing.tiny_mtp.save_agreeing_mtp``): one full attention layer, then
   ``--layers`` - 1 Gated DeltaNet layers whose outputs are scaled down, width
   ``--hidden``, and an MTP layer made to agree with it (its block the first layer, its
   projection keeping the next token's embedding): how often its proposals are kept is a
   property of these weights, stated beside every figure. ``--requests`` prompts of
   ``--prompt-len`` random tokens, greedy, ``--max-tokens`` each, at batch 1 (one after
   another) and at batch ``--batch`` (all at once), once without speculation (``off``) and
   once per ``k`` of ``--k`` with ``{"method": "mtp", "num_speculative_tokens": k,
   "adaptive": false}`` (every decode verifies k proposals); the largest ``k`` also with
   the engine's default ``adaptive``. Each variant's executor is loaded once; each run is a
   fresh engine over it. A round runs every variant of every batch size, in an order
   rotated by one each round; ``--rounds`` rounds. Per batch size and variant:

     out tok/s    output tokens over the run's wall time (the median over rounds)
     ratio        out tok/s over ``off``'s in the same round: the median and the spread
     tok/step     output tokens per engine step (prefill steps included)
     step ms      the run's wall time over its engine steps (the median over rounds)
     accept       accepted over proposed tokens
     identical    every request's tokens equal ``off``'s in the same round

2. **Prefix hits.** ``cliffs.py``'s chat (``--sessions`` 16 sessions of 8 turns,
   ``multisession.py``'s defaults, each prompt the conversation so far) on Qwen3.5-27B's
   layout with its MTP layer's memory planned in, ``--kv-memory`` (8 GiB) at block 16.
   Ours: ``EngineCore`` with the checking ``FakeExecutor`` at our plan (two page sizes,
   block 16), without speculation and with every decode verifying 3 proposed tokens,
   right 3 times in 4 (the fake model has no MTP layer: a stand-in proposer; what is
   measured is the allocator under verification steps, which is all MTP changes there).
   vLLM 0.34.0's own ``KVCacheManager`` (the wheel's sources, fetched into the peer
   cache) at the plan it makes (one page size: the block raised until a page holds a
   state), without and with ``use_eagle``, which its scheduler sets for method mtp
   (``use_eagle_block_drop``: the last matched block is dropped so the draft can
   recompute its hidden state). The hit rate is over the prompt tokens of turns 2-8.

    python -m benchmarks.speculative.mtp [--k 1 2 3] [--rounds 3] [--layers 8]
                                     [--hidden 512] [--no-reference] [--json FILE]

The last line printed is one JSON object; ``--json FILE`` writes it with the command.
Results: docs/benchmarks.md, section "Speculative decoding with the model's MTP layer".
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common.results import add_json_argument, write_json

#: The chat's model: Qwen3.5-27B's published shape (``benchmarks/common/layouts.py``).
HITS_MODEL = "qwen3.5-27b"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-memory", default="8GiB")
    parser.add_argument("--sessions", type=int, default=16, help="the chat's sessions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-reference", action="store_true", help="skip vLLM")
    parser.add_argument("--reference-src", help="an unpacked vLLM 0.34 source tree")
    parser.add_argument("--no-speed", action="store_true", help="prefix hits only")
    add_json_argument(parser)
    return parser.parse_args(argv)


# -- 1. speed ------------------------------------------------------------------------------


def _variants(ks: list[int]) -> list[tuple[str, int, bool]]:
    """(name, k, adaptive): off, each k fixed, the largest k adaptive."""
    out = [("off", 0, False)] + [(f"mtp k={k}", k, False) for k in ks]
    return [*out, (f"mtp k={max(ks)} adaptive", max(ks), True)]


def _run(executor: Any, k: int, adaptive: bool, prompts: list[list[int]], batch: int,
         max_tokens: int) -> dict[str, Any]:  # fmt: skip
    """One run: a fresh engine over ``executor``; its tokens, time, steps and counts."""
    import anyio

    from hybridkv.scheduler import Engine, EngineConfig, SamplingParams
    from hybridkv.scheduler.speculation import SpeculativeConfig

    spec = None
    if k:
        spec = SpeculativeConfig(method="mtp", num_speculative_tokens=k, adaptive=adaptive)
    config = EngineConfig.for_executor(executor, max_model_len=512, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs: dict[int, list[int]] = {}

    async def one(engine: Engine, i: int) -> None:
        async with engine.generate(prompts[i], params) as stream:
            async for out in stream:
                outputs[i] = list(out.token_ids)

    async def serve() -> tuple[float, Any]:
        async with Engine(config, executor) as engine:
            start = time.perf_counter()
            for first in range(0, len(prompts), batch):
                async with anyio.create_task_group() as tg:
                    for i in range(first, min(first + batch, len(prompts))):
                        tg.start_soon(one, engine, i)
            seconds = time.perf_counter() - start
            return seconds, engine.stats()

    seconds, stats = anyio.run(serve)
    spec_stats = stats.spec_decode
    tokens = sum(len(t) for t in outputs.values())
    return {
        "outputs": [outputs[i] for i in range(len(prompts))],
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "tok_per_step": tokens / max(stats.num_steps, 1),
        "step_ms": 1000 * seconds / max(stats.num_steps, 1),
        "accepted": 0 if spec_stats is None else spec_stats.num_accepted_tokens,
        "proposed": 0 if spec_stats is None else spec_stats.num_draft_tokens,
    }


def speed(args: argparse.Namespace) -> dict[str, Any]:
    from hybridkv.executor.load_options import LoadOptions
    from hybridkv.executor.model_executor import ModelExecutor
    from hybridkv.testing.tiny_mtp import save_agreeing_mtp

    folder = Path(tempfile.mkdtemp(prefix="hybridkv-mtp-"))
    save_agreeing_mtp(folder, num_layers=args.layers, hidden_size=args.hidden, seed=args.seed)
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(3, 256) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    variants = _variants(args.k)
    executors = {}
    for name, k, _ in variants:
        options = LoadOptions(kv_cache_bytes=64 << 20, num_threads=args.threads, mtp_proposals=k)
        executors[name] = ModelExecutor.from_pretrained(folder, options)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for round_ in range(args.rounds):
        order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
        for batch in (1, args.batch):
            for name, k, adaptive in order:
                run = _run(executors[name], k, adaptive, prompts, batch, args.max_tokens)
                runs.setdefault(str(batch), {}).setdefault(name, []).append(run)
    for executor in executors.values():
        executor.close()
    return {
        "model": {"layers": args.layers, "hidden": args.hidden, "shape": "qwen3.5 (agreeing)"},
        "cells": {batch: _summary(cell, variants) for batch, cell in runs.items()},
    }


def _summary(cell: dict[str, list[dict[str, Any]]], variants: list[Any]) -> dict[str, Any]:
    base = cell["off"]
    out = {}
    for name, _, _ in variants:
        runs = cell[name]
        ratios = [r["tok_s"] / b["tok_s"] for r, b in zip(runs, base, strict=True)]
        proposed = sum(r["proposed"] for r in runs)
        out[name] = {
            "tok_s": round(statistics.median(r["tok_s"] for r in runs), 1),
            "ratio": round(statistics.median(ratios), 3),
            "ratio_spread": [round(min(ratios), 3), round(max(ratios), 3)],
            "tok_per_step": round(statistics.median(r["tok_per_step"] for r in runs), 2),
            "step_ms": round(statistics.median(r["step_ms"] for r in runs), 1),
            "accept": None
            if not proposed
            else round(sum(r["accepted"] for r in runs) / proposed, 3),
            "identical": all(r["outputs"] == b["outputs"] for r, b in zip(runs, base, strict=True)),
        }
    return out


# -- 2. prefix hits ------------------------------------------------------------------------


def hits(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.common.layouts import build_layout, hybrid_layout, model_specs
    from benchmarks.hybrid.vllm_mamba import load_reference, run_vllm
    from benchmarks.hybrid.workloads import VOCAB, chat_jobs, run_ours
    from hybridkv.memory.sizes import parse_size
    from hybridkv.scheduler.speculation import SpeculativeConfig
    from hybridkv.testing.proposers import ReferenceProposer

    budget = parse_size(args.kv_memory)
    jobs, settings = chat_jobs(args.seed, args.sessions)
    in_flight, step_budget = settings["in_flight"], settings["budget"]
    specs = model_specs(HITS_MODEL, mtp=True)
    ours = hybrid_layout(HITS_MODEL, build_layout(HITS_MODEL, budget, 16, mtp=True), specs)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False)
    proposer = ReferenceProposer(VOCAB, miss=0.25, seed=args.seed, random_length=False)
    out: dict[str, Any] = {
        "settings": settings,
        "hybridkv off": run_ours(ours, jobs, in_flight, step_budget),
        "hybridkv mtp": run_ours(
            ours, jobs, in_flight, step_budget, speculative=spec, proposer=proposer
        ),
        "hybridkv_block_size": 16,
    }
    vllm, loaded = load_reference(args, "0.34.0")
    out["vllm_status"] = loaded
    if vllm is not None:
        plan = build_layout(HITS_MODEL, budget, 16, one_page=True, mtp=True)
        theirs = hybrid_layout(HITS_MODEL, plan, specs)
        out["vllm_block_size"] = plan.block_size
        out["vllm off"] = run_vllm(vllm, theirs, jobs, in_flight, step_budget)
        out["vllm mtp"] = run_vllm(vllm, theirs, jobs, in_flight, step_budget, use_eagle=True)
    return out


# -- report ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results: dict[str, Any] = {}
    if not args.no_speed:
        results["speed"] = speed(args)
        for batch, cell in results["speed"]["cells"].items():
            print(f"\nbatch {batch}: {args.requests} requests, {args.max_tokens} tokens each")
            print(f"{'variant':22} {'tok/s':>7} {'ratio':>6} {'spread':>13} {'tok/step':>8} "
                  f"{'step ms':>7} {'accept':>6} identical")  # fmt: skip
            for name, row in cell.items():
                spread = "{:.2f}-{:.2f}".format(*row["ratio_spread"])
                accept = "" if row["accept"] is None else f"{row['accept']:.2f}"
                print(f"{name:22} {row['tok_s']:7.1f} {row['ratio']:6.2f} {spread:>13} "
                      f"{row['tok_per_step']:8.2f} {row['step_ms']:7.1f} {accept:>6} "
                      f"{row['identical']}")  # fmt: skip
    results["hits"] = hits(args)
    h = results["hits"]
    print(
        f"\nprefix hits, {HITS_MODEL} with its MTP layer, the chat's turns 2-8 ({h['vllm_status']})"
    )
    for key in ("hybridkv off", "hybridkv mtp", "vllm off", "vllm mtp"):
        if key in h:
            row = h[key]
            rate = row.get("hit_rate", row)
            tokens = row.get("tokens_hit", "")
            block = (
                h["hybridkv_block_size"] if key.startswith("hybridkv") else h.get("vllm_block_size")
            )
            print(f"{key:14} block {block!s:>5}  hit rate {rate}  tokens hit {tokens}")
    write_json(args.json, results)
    print(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
