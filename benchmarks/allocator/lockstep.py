"""Schedulers with a zero-time model, stepped in lockstep, and their step statistics.

A *side* is one scheduler behind four members: ``name``, ``has_work``,
``add(request_id, prompt, params)`` and ``step()``, which runs one step and returns
``(wall_us, cpu_us, num_requests, is_decode)``: microseconds spent in the scheduler (wall
clock and this thread's CPU time, which a busy machine does not inflate), requests run,
and whether every one of them ran exactly one token. :func:`drive` steps several sides
alternately, who goes first swapping every step, so that all see the same machine load.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from hybridkv.scheduler import EngineConfig, SamplingParams
from hybridkv.scheduler.core import EngineCore

Step = tuple[float, float, int, bool]
# (arrival step, request id, prompt, params)
Arrival = tuple[int, str, list[int], SamplingParams]


class Side(Protocol):
    name: str

    @property
    def has_work(self) -> bool: ...

    def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None: ...

    def step(self) -> Step: ...


class _Sink:
    """Discards outputs (the core-driven runs have no consumer)."""

    def send_nowait(self, item: object) -> None:
        pass

    def close(self) -> None:
        pass


class CoreSide:
    """hybridkv's ``EngineCore`` driven synchronously: plan, executor, apply, flush.

    A step's time is ``plan()`` (admission, prefix lookup, allocation, batch building)
    plus ``apply()`` and ``flush()`` (append tokens, stop checks, outputs delivered to a
    sink that drops them); the executor's time between them is not counted.
    """

    name = "hybridkv"

    def __init__(self, config: EngineConfig, executor: Any) -> None:
        self.core = EngineCore(config)
        self.executor = executor

    @property
    def has_work(self) -> bool:
        return self.core.has_work

    def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.core.add_request(prompt, params, _Sink(), request_id=request_id)

    def step(self) -> Step:
        core = self.core
        clock, cpu = time.perf_counter, time.thread_time
        t0, c0 = clock(), cpu()
        plan = core.plan()
        t1, c1 = clock(), cpu()
        if not plan.scheduled:
            core.flush()
            return (0.0, 0.0, 0, False)  # all preempted: a step for arrivals' sake
        sampled = self.executor.execute(plan.batch)
        t2, c2 = clock(), cpu()
        core.apply(plan, sampled)
        core.flush()
        wall = (t1 - t0 + clock() - t2) * 1e6
        used = (c1 - c0 + cpu() - c2) * 1e6
        num = len(plan.scheduled)
        return (wall, used, num, plan.num_tokens == num)


class ReferenceSide:
    """vLLM's scheduler (``_vllm_scheduler.ReferenceScheduler``); its fake model samples
    ``output_tokens(request_id, prompt, params)`` for each request, one token a step."""

    name = "vllm"

    def __init__(
        self,
        scheduler: Any,
        output_tokens: Callable[[str, list[int], SamplingParams], Sequence[int]],
    ) -> None:
        self.scheduler = scheduler
        self._output_tokens = output_tokens

    @classmethod
    def for_config(
        cls, vllm: Any, groups: list[dict[str, Any]], config: EngineConfig, output_tokens: Any
    ) -> ReferenceSide:
        """vLLM's scheduler on the pool, limits and KV groups of ``config`` (``groups`` in
        the traces' format); ``vllm`` is what ``_vllm_scheduler.load`` returned."""
        from benchmarks.allocator.vllm_scheduler import ReferenceScheduler

        scheduler = ReferenceScheduler(
            vllm,
            groups,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        return cls(scheduler, output_tokens)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.has_work)

    @property
    def num_finished(self) -> int:
        return int(self.scheduler.num_finished)

    @property
    def num_output_tokens(self) -> int:
        return int(self.scheduler.num_output_tokens)

    def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        tokens = self._output_tokens(request_id, prompt, params)
        self.scheduler.add(request_id, prompt, tokens)

    def step(self) -> Step:
        step: Step = self.scheduler.step()
        return step if step[2] else (0.0, 0.0, 0, False)  # as CoreSide counts an empty step


def drive(
    sides: Sequence[Side], arrivals: Sequence[Arrival], max_steps: int = 1_000_000
) -> list[list[Step]]:
    """Step every side until it is idle, in lockstep; returns each side's steps.

    A request joins a side just before that side's step number ``arrival step``. The
    garbage collector's existing objects are frozen first, so that collections scan only
    what the run allocates.
    """
    pending = sorted(arrivals, key=lambda a: a[0])
    logs: list[list[Step]] = [[] for _ in sides]
    nexts = [0] * len(sides)
    gc.collect()
    gc.freeze()
    try:
        order = list(range(len(sides)))
        while True:
            stepped = False
            for i in order:
                side, log = sides[i], logs[i]
                while nexts[i] < len(pending) and pending[nexts[i]][0] <= len(log):
                    _, request_id, prompt, params = pending[nexts[i]]
                    side.add(request_id, prompt, params)
                    nexts[i] += 1
                if (side.has_work or nexts[i] < len(pending)) and len(log) < max_steps:
                    log.append(side.step())
                    stepped = True
            if not stepped:
                break
            order.reverse()
    finally:
        gc.unfreeze()
    return logs


def decode_stats(steps: list[Step], num_running: int | None = None) -> dict[str, Any]:
    """Medians over all steps and over decode-only steps (running ``num_running``)."""
    decode = [s for s in steps if s[3] and (num_running is None or s[2] == num_running)]
    median = statistics.median
    return {
        "steps": len(steps),
        "step_us_median": round(median(s[0] for s in steps), 1),
        "step_cpu_us_median": round(median(s[1] for s in steps), 1),
        "decode_step_us_median": round(median(s[0] for s in decode), 1) if decode else None,
        "decode_step_cpu_us_median": round(median(s[1] for s in decode), 1) if decode else None,
    }


def with_reference(row: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Add the reference's medians to ``row``, ``ratio`` (ours over vLLM's median decode
    step, wall time) and ``cpu_ratio`` (the same in thread CPU time, which other load on
    the machine disturbs less)."""

    def ratio(key: str) -> float | None:
        ours, theirs = row.get(key), ref[key]
        return round(ours / theirs, 3) if ours and theirs else None

    row.update(
        reference_steps=ref["steps"],
        reference_step_us_median=ref["step_us_median"],
        reference_decode_step_us_median=ref["decode_step_us_median"],
        reference_decode_step_cpu_us_median=ref["decode_step_cpu_us_median"],
        ratio=ratio("decode_step_us_median"),
        cpu_ratio=ratio("decode_step_cpu_us_median"),
    )
    return row


def check_same_work(ours: CoreSide, ref: ReferenceSide, num_output_tokens: int) -> None:
    """Both finished every request, and vLLM generated every token (ours is tested)."""
    done = ours.core.num_finished
    if done != ref.num_finished or ref.num_output_tokens != num_output_tokens:
        raise RuntimeError(
            f"requests finished: ours {done}, vLLM {ref.num_finished}; vLLM generated "
            f"{ref.num_output_tokens} tokens, expected {num_output_tokens}"
        )
