"""Scheduling overhead of the engine with a zero-time model, and the loop's responsiveness.

Three parts:
  overhead      for a full-attention and a 5:1 sliding-window:full layout, at 64, 256 and
                1024 running requests: microseconds per step spent planning (admission,
                allocation, batch building) plus applying outputs (append, stop checks,
                streaming), timed around EngineCore.plan/apply with the fake executor; and
                steps per second of the async Engine on the same workload (fake executor
                and worker-thread hop included).
  responsiveness  while a slow executor runs 20 ms steps, how long a newly submitted
                request waits until it is part of a step.
  trace         with a path argument, the request list of a recorded trace
                (format "kvcm-trace/1", see the traces README) replayed through the core,
                so that other schedulers can be run on the same workload.

Reference: vLLM's own scheduler measured about 12.9 ms per decode step at 256 running
requests (about 50 us per request per step) on full + sliding window; the goal is half.

    python benchmarks/scheduler.py                  # overhead + responsiveness
    python benchmarks/scheduler.py TRACE.json       # replay a trace's requests

The last line printed is one JSON object (``step_us_median``, ``decode_step_us_median``).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import structlog

from hybridkv.policies import FullAttention, MemoryPolicy, SlidingWindow, cdiv
from hybridkv.scheduler import Engine, EngineConfig, FakeExecutor, SamplingParams, StepBatch
from hybridkv.scheduler.core import EngineCore

VLLM_DECODE_STEP_US = 12_900.0
BLOCK_SIZE = 16
BUDGET = 8192  # max_num_batched_tokens of the synthetic workloads
LAYOUTS: dict[str, tuple[MemoryPolicy, ...]] = {
    "full": (FullAttention(),),
    # One group per 1/6 of the layers, as the hybrid allocator groups a 5:1 model.
    "swa5:full1": (FullAttention(),) + (SlidingWindow(window=256),) * 5,
}


class _Sink:
    """Discards outputs (the core-driven runs have no consumer)."""

    def send_nowait(self, item: object) -> None:
        pass

    def close(self) -> None:
        pass


def workload_config(
    policies: tuple[MemoryPolicy, ...], num_running: int, total: int
) -> EngineConfig:
    pages = cdiv(total, BLOCK_SIZE) + 1
    return EngineConfig(
        policies=policies,
        num_blocks=num_running * pages * len(policies) + 1,
        block_size=BLOCK_SIZE,
        max_model_len=total + 1,
        max_num_seqs=num_running,
        max_num_batched_tokens=BUDGET,
    )


def drive_core(
    core: EngineCore,
    executor: Any,
    arrivals: Sequence[tuple[int, list[int], SamplingParams]] = (),
    max_steps: int = 1_000_000,
) -> list[tuple[float, float, int, bool]]:
    """Step the core until idle; per step: microseconds of plan + apply (outputs delivered
    included), in wall time and in this thread's CPU time (which a busy machine does not
    inflate), requests run, and whether every one of them only decoded."""
    steps: list[tuple[float, float, int, bool]] = []
    pending = sorted(arrivals, key=lambda a: a[0])
    k = 0
    clock, cpu = time.perf_counter, time.thread_time
    while (core.has_work or k < len(pending)) and len(steps) < max_steps:
        while k < len(pending) and pending[k][0] <= len(steps):
            _, prompt, params = pending[k]
            core.add_request(prompt, params, _Sink(), request_id=str(k))
            k += 1
        t0, c0 = clock(), cpu()
        plan = core.plan()
        t1, c1 = clock(), cpu()
        if not plan.scheduled:
            core.flush()
            steps.append((0.0, 0.0, 0, False))  # all preempted: a step for arrivals' sake
            continue
        sampled = executor.execute(plan.batch)
        t2, c2 = clock(), cpu()
        core.apply(plan, sampled)
        core.flush()
        wall = (t1 - t0 + clock() - t2) * 1e6
        used = (c1 - c0 + cpu() - c2) * 1e6
        num = len(plan.scheduled)
        steps.append((wall, used, num, plan.num_tokens == num))
    return steps


def bench_overhead(layout: str, num_running: int, args: argparse.Namespace) -> dict[str, Any]:
    # Outputs long enough that every request still decodes once the last prompt is in:
    # at least ``decode_steps`` steps run all ``num_running`` requests as decodes.
    prefill_steps = cdiv(num_running * args.prompt_len, BUDGET)
    max_tokens = args.decode_steps + prefill_steps
    config = workload_config(LAYOUTS[layout], num_running, args.prompt_len + max_tokens)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompts = [[(i * 7919 + j) % 32000 for j in range(args.prompt_len)] for i in range(num_running)]
    core = EngineCore(config)
    arrivals = [(0, p, params) for p in prompts]
    steps = drive_core(core, FakeExecutor.for_config(config), arrivals)
    full = [(us, cpu) for us, cpu, num, is_decode in steps if is_decode and num == num_running]
    full_decode = [us for us, _ in full]
    steps_per_s = anyio.run(engine_steps_per_s, config, prompts, params)
    return {
        "layout": layout,
        "num_running": num_running,
        "num_groups": len(config.policies),
        "steps": len(steps),
        "step_us_median": round(statistics.median(s[0] for s in steps), 1),
        "decode_step_us_median": round(statistics.median(full_decode), 1),
        "decode_step_cpu_us_median": round(statistics.median(cpu for _, cpu in full), 1),
        "decode_us_per_request": round(statistics.median(full_decode) / num_running, 2),
        "engine_steps_per_s": round(steps_per_s, 1),
    }


async def engine_steps_per_s(
    config: EngineConfig, prompts: list[list[int]], params: SamplingParams
) -> float:
    async with Engine(config, FakeExecutor.for_config(config)) as engine:
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for prompt in prompts:
                tg.start_soon(_drain, engine, prompt, params)
        return engine.stats().num_steps / (time.perf_counter() - start)


async def _drain(engine: Engine, prompt: list[int], params: SamplingParams) -> None:
    async for _ in engine.generate(prompt, params):
        pass


class _StampingExecutor(FakeExecutor):
    """A slow fake that records when each request id first appears in a step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.first_seen: dict[str, float] = {}

    def execute(self, batch: StepBatch) -> list[int | None]:
        now = time.perf_counter()
        for request in batch.requests:
            self.first_seen.setdefault(request.request_id, now)
        return super().execute(batch)


async def bench_responsiveness(args: argparse.Namespace) -> dict[str, Any]:
    """Admission wait of probes submitted at random moments while 20 ms steps run."""
    step_s = 0.02
    config = workload_config(LAYOUTS["full"], 65, 2000)
    executor = _StampingExecutor(
        config.num_blocks, BLOCK_SIZE, 1, vocab_size=32000, step_delay_s=step_s
    )
    background = SamplingParams(max_tokens=1500, ignore_eos=True)
    rng = random.Random(0)
    waits: list[float] = []
    async with Engine(config, executor) as engine, anyio.create_task_group() as tg:
        for i in range(64):
            tg.start_soon(_drain, engine, [i + 1] * 64, background)
        await anyio.sleep(3 * step_s)
        for n in range(args.probes):
            await anyio.sleep(rng.uniform(0, step_s))
            rid = f"probe{n}"
            submitted = time.perf_counter()
            async for _ in engine.generate([7] * 16, SamplingParams(max_tokens=1), request_id=rid):
                pass
            waits.append((executor.first_seen[rid] - submitted) * 1e3)
        tg.cancel_scope.cancel()
    return {
        "step_ms": step_s * 1e3,
        "admission_wait_ms_median": round(statistics.median(waits), 2),
        "admission_wait_ms_max": round(max(waits), 2),
    }


def bench_trace(path: Path) -> dict[str, Any]:
    """Replay a trace's requests (arrivals by step, prompts, output lengths) through the core."""
    trace = json.loads(path.read_text())
    cfg = trace["config"]
    policies = tuple(
        FullAttention() if g["type"] == "full" else SlidingWindow(window=g["sliding_window"])
        for g in cfg["groups"]
    )
    config = EngineConfig(
        policies=policies,
        num_blocks=cfg["num_blocks"],
        block_size=cfg["block_size"],
        max_model_len=cfg["max_model_len"],
        max_num_seqs=cfg.get("concurrency", 256),
        max_num_batched_tokens=cfg["max_batched_tokens"],
        enable_prefix_caching=cfg["enable_prefix_caching"],
        max_waiting=len(trace["requests"]) + 1,
    )
    arrivals = []
    output_starts: dict[str, int] = {}
    for i, req in enumerate(trace["requests"]):
        prompt = [t for start, length in req["prompt"] for t in range(start, start + length)]
        out_start, out_len = req["output"]
        output_starts[str(i)] = out_start
        params = SamplingParams(max_tokens=out_len, ignore_eos=True)
        arrivals.append((req["arrival_step"], prompt, params))

    class TraceExecutor:
        """Samples the trace's own output tokens: output j of request i is start_i + j."""

        def execute(self, batch: StepBatch) -> list[int | None]:
            return [
                output_starts[r.request_id] + r.output_index if r.sample else None
                for r in batch.requests
            ]

    core = EngineCore(config)
    steps = drive_core(core, TraceExecutor(), arrivals)
    decode = [us for us, _, _, is_decode in steps if is_decode]
    usage = core.kv.usage()
    summary = trace.get("summary", {})
    return {
        "trace": path.name,
        "requests": len(arrivals),
        "steps": len(steps),
        "step_us_median": round(statistics.median(s[0] for s in steps), 1),
        "decode_step_us_median": round(statistics.median(decode), 1) if decode else None,
        "step_cpu_us_median": round(statistics.median(s[1] for s in steps), 1),
        "preemptions": core.num_preemptions,
        "prefix_hit_tokens": usage.prefix_hit_tokens,
        "prefix_query_tokens": usage.prefix_query_tokens,
        "reference": {k: summary.get(k) for k in ("steps", "preemptions", "prefix_hit_tokens")},
    }


def main() -> None:
    args = parse_args()
    # The library never configures logging; this script does, so per-request events cost
    # what a production filter costs rather than console rendering.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if args.trace is not None:
        result = bench_trace(args.trace)
        print(json.dumps(result, indent=1))
        print(
            json.dumps(
                {
                    "step_us_median": result["step_us_median"],
                    "decode_step_us_median": result["decode_step_us_median"],
                    **result,
                }
            )
        )
        return
    print(f"prompt={args.prompt_len} decode_steps={args.decode_steps} block={BLOCK_SIZE}")
    print(
        f"{'layout':<11} {'running':>7} {'groups':>6} {'steps':>6} {'step us':>9} "
        f"{'decode us':>10} {'(cpu)':>8} {'us/req':>7} {'engine steps/s':>15}"
    )
    rows = []
    for layout in LAYOUTS:
        for num_running in args.running:
            row = bench_overhead(layout, num_running, args)
            rows.append(row)
            print(
                f"{layout:<11} {num_running:>7} {row['num_groups']:>6} {row['steps']:>6} "
                f"{row['step_us_median']:>9.1f} {row['decode_step_us_median']:>10.1f} "
                f"{row['decode_step_cpu_us_median']:>8.1f} "
                f"{row['decode_us_per_request']:>7.2f} {row['engine_steps_per_s']:>15.1f}"
            )
    resp = anyio.run(bench_responsiveness, args)
    print(
        f"responsiveness: {resp['step_ms']:.0f} ms steps, a new request waits "
        f"{resp['admission_wait_ms_median']:.1f} ms (median), "
        f"{resp['admission_wait_ms_max']:.1f} ms (max) to join a step"
    )
    head = next(
        (r for r in rows if r["layout"] == "swa5:full1" and r["num_running"] == 256), rows[-1]
    )
    print(
        json.dumps(
            {
                "step_us_median": head["step_us_median"],
                "decode_step_us_median": head["decode_step_us_median"],
                "decode_step_cpu_us_median": head["decode_step_cpu_us_median"],
                "headline": f"{head['layout']} at {head['num_running']} running",
                "vllm_decode_step_us": VLLM_DECODE_STEP_US,
                "ratio_to_vllm": round(head["decode_step_us_median"] / VLLM_DECODE_STEP_US, 3),
                **resp,
                "rows": rows,
            }
        )
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", nargs="?", type=Path, help="a kvcm-trace/1 JSON file")
    parser.add_argument("--running", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--probes", type=int, default=30)
    return parser.parse_args()


if __name__ == "__main__":
    main()
