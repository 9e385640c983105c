"""Workloads for the allocator benchmark: recorded traces and generated ones.

A trace (format "kvcm-trace/1", see ``shared/traces/README.md``) lists the requests (prompt
and output token spans) and, per engine step, every call the engine made to its KV cache
allocator. :func:`generate` builds the same structure for a synthetic continuous-batching
workload, so that ``allocator.py`` replays both the same way.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any

import attrs

LAYOUTS = {
    "full": [{"type": "full"}],
    # Gemma 3 (1B): five local layers of window 512 per global layer.
    "gemma3": [{"type": "sliding_window", "sliding_window": 512}] * 5 + [{"type": "full"}],
}
Op = list[Any]


@attrs.frozen
class Trace:
    """A workload at the allocator level: requests and the operations of every step."""

    name: str
    config: dict[str, Any]
    prompts: list[list[list[int]]]  # per request, [start, length] spans
    outputs: list[list[int]]  # per request, [start, length]
    steps: list[list[Op]]
    summary: dict[str, Any] = attrs.field(factory=dict)

    @classmethod
    def load(cls, path: Path) -> Trace:
        data = json.loads(path.read_text())
        if data.get("format") != "kvcm-trace/1":
            raise ValueError(f"{path}: format {data.get('format')!r}, expected 'kvcm-trace/1'")
        reqs = data["requests"]
        prompts, outputs = [r["prompt"] for r in reqs], [r["output"] for r in reqs]
        return cls(
            path.stem, data["config"], prompts, outputs, data["steps"], data.get("summary", {})
        )

    def prompt(self, index: int) -> list[int]:
        return [t for start, length in self.prompts[index] for t in range(start, start + length)]


def decode_only(ops: list[Op]) -> bool:
    """A step whose operations are all one-token decodes or sampled tokens."""
    return all(op[0] == "S" or (op[0] == "D" and op[2] == 1) for op in ops)


def generate(layout: str, num_running: int, shared: bool, prompt_len: int = 512) -> Trace:
    """A continuous-batching workload: ``2 * num_running`` requests, each admitted when a
    slot frees, prompts chunked to 8192 tokens a step, 128 output tokens. Prompt lengths
    vary by up to 15 tokens, so that requests cross block boundaries on different steps.
    With ``shared``, the first half of each prompt is one of 8 common prefixes."""
    output_len, budget, bs = 128, 8192, 16
    num_req, half = 2 * num_running, prompt_len // 2 if shared else 0
    lengths = [prompt_len + i % bs for i in range(num_req)]
    prompts = [
        ([[(i % 8) * 100_000, half]] if shared else [])
        + [[10_000_000 + i * (prompt_len + bs), lengths[i] - half]]
        for i in range(num_req)
    ]
    outputs = [[500_000_000 + i * output_len, output_len] for i in range(num_req)]
    waiting, running, steps = deque(range(num_req)), {}, []
    ready: set[int] = set()  # prefixes whose blocks an allocation has cached
    while waiting or running:
        ops: list[Op] = []
        left, scheduled = budget, []
        for i, st in running.items():  # st = [computed, tokens, generated]
            if n := min(st[1] - st[0], left):
                ops.append(["D", i, n, None])
                st[0] += n
                left -= n
                scheduled.append(i)
        while waiting and len(running) < num_running and left > 0:
            i = waiting.popleft()
            hit = half if shared and i % 8 in ready else 0
            n = min(lengths[i] - hit, left)
            ops.append(["A", i, hit, n, None])
            running[i] = [hit + n, lengths[i], 0]
            left -= n
            scheduled.append(i)
            if shared and hit + n >= half:  # later admissions in this step hit it already
                ready.add(i % 8)
        for i in scheduled:
            st = running[i]
            if shared and st[0] >= half:
                ready.add(i % 8)
            if st[0] == st[1]:
                ops.append(["S", i])
                st[1] += 1
                st[2] += 1
                if st[2] == output_len:
                    ops.append(["F", i])
                    del running[i]
        steps.append(ops)
    groups, pages = LAYOUTS[layout], -(-(prompt_len + bs + output_len) // bs)
    config = {
        "block_size": bs,
        "groups": groups,
        "num_blocks": num_running * pages * len(groups) + 1,  # every request fits
        "max_model_len": prompt_len + bs + output_len,
    }
    name = f"{layout}-c{num_running}-L{prompt_len}" + ("-shared" if shared else "")
    return Trace(name, config, prompts, outputs, steps)
