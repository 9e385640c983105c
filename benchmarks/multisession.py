"""Prefix cache under pressure: independent chat sessions served round-robin.

The workload of vLLM issue 48435, generated here: ``--sessions`` independent chats of
``--turns`` turns each, every session with its own ``--system-tokens`` system prompt;
turn t's prompt is the whole conversation so far plus a new user message, and its reply
joins the next turn's prompt. Turns are queued round-robin (every session's turn 1, then
every session's turn 2, ...; a session's next turn is queued when its reply ends) and at
most ``--in-flight`` requests run at once, so a session comes back only after every
other one was served: the least recently used prefix is always the next one needed.

The pool holds the sessions' working set divided by an occupancy, under two definitions
of the working set (``--working-set``; both are printed by default):

- peak (vLLM issue 48435's): what every session holds at its longest, in every group:
  ``KVCacheManager.num_blocks_needed`` of its last turn's length (every block in a
  full-attention group, a window's worth in a sliding-window one). Occupancy 1.0 is a
  pool that can keep every session resumable to the end and no more.
- mean: the pages the sessions' prefixes need to be resumed (``prefix_pages``), averaged
  over the turns a next turn resumes from. The peak definition puts the layouts under
  unequal pressure: a session's windows cost the same from its first turn on, so after
  turn 1 the hybrid's prefixes already need a larger share of its peak than full
  attention's do (``--per-turn`` prints the shares), and at equal peak occupancy the
  hybrid's pool is fuller at every turn but the last. Equal mean occupancy is equal
  pressure averaged over the run.

The allocator is driven with the verbs of ``allocator.py``'s replay (lookup, admit,
extend, append, free), by a loop that follows the engine's planner: running requests
first (chunked prefill within a token budget, one token per decode; when one cannot
grow, the newest other running request is preempted and recomputed later), then
admissions in queue order, each with a prefix lookup. A prefill chunk is first shortened
as the planner does (``KVCacheManager.spare_chunk``, not below ``--min-chunk``) where a
shorter one spares a kept prefix its pages; vLLM's scheduler never does.

Printed: the prefix hit rate of turns 2 to the last (cached prompt tokens over prompt
tokens, at each turn's first admission) per layout and occupancy, and the allocator's
time per step (``perf_counter_ns`` around each of the step's calls to it, appending
sampled tokens included as in ``allocator.py``: vLLM hashes blocks there; mean over
steps). Under the hit
rates, a *capacity estimate* per layout (``capacity_estimate``): what an eviction order
could reach if the pool could be shared out among the waiting sessions' prefixes at will.
With ``--per-turn``, also each turn's hit rate and the pages the sessions' prefixes need
after each turn, over the working set (the pool must hold that to let every next turn
hit). With ``--reference-src DIR`` (a vLLM source tree, see ``_vllm_reference.py``),
vLLM's own KVCacheManager serves the same workload in a run of its own.

    python benchmarks/multisession.py [--repeats N] [--per-turn] [--reference-src DIR]
                                      [--json FILE]

The last line printed is one JSON object: per working-set definition, allocator, layout
and occupancy the hit rate, preemptions and the allocator's microseconds per step (the
best of the repeats). ``--json FILE`` writes the same object to FILE, with the workload's
settings and the command (``benchmarks/plot.py`` draws the hit rates from it).

Other benchmarks reuse the workload: ``parse_args([])`` gives the defaults, ``Session``
generates a chat, and ``Run(make, LAYOUTS[name], occupancy, args).run()`` serves it
through any allocator with ``OursAllocator``'s verbs (``make(groups, num_blocks)``).

Results: docs/benchmarks.md, section "Prefix cache under pressure: chat sessions served
round-robin".
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import attrs
from _results import add_json_argument, write_json
from allocator import OursAllocator

from hybridkv.memory import KVCacheManager
from hybridkv.policies import FullAttention, MemoryPolicy, SlidingWindow
from hybridkv.scheduler.config import EngineConfig

BLOCK_SIZE = 16
WINDOW = 1024
LAYOUTS: dict[str, list[dict[str, Any]]] = {
    "full": [{"type": "full"}],
    "1 full + 5 sliding": [{"type": "full"}]
    + [{"type": "sliding_window", "sliding_window": WINDOW}] * 5,
}
OCCUPANCIES = (0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0)


def policies(groups: list[dict[str, Any]]) -> list[MemoryPolicy]:
    return [
        FullAttention() if g["type"] == "full" else SlidingWindow(window=g["sliding_window"])
        for g in groups
    ]


def prefix_pages(groups: list[dict[str, Any]], num_tokens: int) -> int:
    """Pages a prefix of the filled blocks of ``num_tokens`` tokens needs to be resumed:
    in each group, the blocks its policy reads after the prefix."""
    num_blocks = num_tokens // BLOCK_SIZE
    return sum(
        min(stop, num_blocks) - start
        for policy in policies(groups)
        for start, stop in policy.live_block_spans(num_blocks * BLOCK_SIZE, BLOCK_SIZE)
        if start < num_blocks
    )


def capacity_estimate(
    sessions: list[Session], groups: list[dict[str, Any]], num_blocks: int, args: Any
) -> float:
    """The hit rate over turns 2 on if the pool's pages could be shared out among the
    waiting sessions' prefixes at will (an estimate of the best any eviction order does).

    While ``in_flight`` requests run, the other sessions wait, and a waiting session hits
    only if its whole prefix was kept through the wait. For turn t, the pages the running
    requests leave (the pool less ``in_flight`` times what a turn-t request holds at its
    longest) over what the waiting sessions' prefixes need (the mean after turn t-1) is
    the share of those prefixes a pool can keep; each turn-t request is credited that
    share of its hit. Full attention's prefixes do shrink block by block, and its measured
    hit rate comes close to this (how close: docs/benchmarks.md); a sliding-window prefix
    resumes only whole, so for the hybrid it is optimistic.
    """
    manager = KVCacheManager(policies(groups), 2, BLOCK_SIZE)
    num_waiting = len(sessions) - args.in_flight
    hit = prompt = 0.0
    for turn in range(1, args.turns):
        held = [manager.num_blocks_needed(s.turn_length(turn)) for s in sessions]
        kept = [prefix_pages(groups, s.turn_length(turn - 1)) for s in sessions]
        spare = num_blocks - args.in_flight * statistics.fmean(held)
        share = min(1.0, max(0.0, spare / (num_waiting * statistics.fmean(kept))))
        for s in sessions:
            hit += share * (s.turn_length(turn - 1) // BLOCK_SIZE * BLOCK_SIZE)
            prompt += len(s.prompt(turn))
    return round(hit / prompt, 3)


class Session:
    """A chat: a system prompt, then per turn a user message and the model's reply."""

    def __init__(self, index: int, rng: random.Random, args: argparse.Namespace) -> None:
        def tokens(n: int) -> list[int]:
            return [rng.randrange(1, 1 << 31) for _ in range(n)]

        self.index = index
        self.system = tokens(args.system_tokens)
        self.messages = [tokens(rng.randint(*args.user_tokens)) for _ in range(args.turns)]
        self.replies = [tokens(rng.randint(*args.reply_tokens)) for _ in range(args.turns)]

    def prompt(self, turn: int) -> list[int]:
        """Turn ``turn``'s prompt (0-based): system, earlier messages and replies, message."""
        out = list(self.system)
        for i in range(turn):
            out += self.messages[i] + self.replies[i]
        return out + self.messages[turn]

    def turn_length(self, turn: int) -> int:
        """Tokens computed by turn ``turn`` (its last reply token is never computed)."""
        return len(self.prompt(turn)) + len(self.replies[turn]) - 1

    def final_length(self) -> int:
        """Tokens computed by the last turn."""
        return self.turn_length(len(self.messages) - 1)


class Turn:
    """One request: its session, turn, and how far it got."""

    __slots__ = ("computed", "index", "num_generated", "num_prompt", "session", "turn")

    def __init__(self, session: Session, turn: int, num_turns: int) -> None:
        self.session, self.turn = session, turn
        self.index = session.index * num_turns + turn
        self.num_prompt = len(session.prompt(turn))  # tokens before the next sample
        self.num_generated = 0
        self.computed = 0


class Run:
    """One allocator, layout and occupancy, through every session's last turn."""

    def __init__(self, make: Any, groups: list[dict[str, Any]], occupancy: float, args: Any):
        rng = random.Random(args.seed)
        self.sessions = [Session(i, rng, args) for i in range(args.sessions)]
        probe = KVCacheManager(policies(groups), 2, BLOCK_SIZE)
        peak = sum(probe.num_blocks_needed(s.final_length()) for s in self.sessions)
        # Pages every session's prefix needs after each turn: what a pool must keep to let
        # every next turn hit.
        needs = [
            sum(prefix_pages(groups, s.turn_length(t)) for s in self.sessions)
            for t in range(args.turns)
        ]
        self.prefix_share = [round(n / peak, 3) for n in needs]
        self.working_set = peak
        if args.definition == "mean":  # over the turns a next turn resumes from
            self.working_set = round(statistics.fmean(needs[:-1]))
        self.num_blocks = round(self.working_set / occupancy) + 1
        self.capacity_estimate = capacity_estimate(self.sessions, groups, self.num_blocks, args)
        self.alloc = make(groups, self.num_blocks)
        self.args = args
        self.waiting: deque[Turn] = deque(self._turn(s, 0) for s in self.sessions)
        self.running: list[Turn] = []
        self.admitted: set[int] = set()
        self.per_turn = [[0, 0] for _ in range(args.turns)]  # hit tokens, prompt tokens
        self.num_preemptions = 0
        self.step_ns: list[int] = []

    def _turn(self, session: Session, turn: int) -> Turn:
        request = Turn(session, turn, self.args.turns)
        self.alloc.add(request.index, session.prompt(turn))
        return request

    def run(self) -> dict[str, Any]:
        gc.collect()
        gc.freeze()
        while self.waiting or self.running:
            self.step()
        gc.unfreeze()
        later = self.per_turn[1:]
        us = [ns / 1000 for ns in self.step_ns]
        return {
            "hit_rate": round(sum(h for h, _ in later) / max(1, sum(q for _, q in later)), 3),
            "per_turn": [round(h / max(1, q), 3) for h, q in self.per_turn],
            "preemptions": self.num_preemptions,
            "steps": len(us),
            "step_us_mean": round(statistics.fmean(us), 2),
            "step_us_median": round(statistics.median(us), 2),
            "num_blocks": self.num_blocks,
            "working_set": self.working_set,
            "prefix_share": self.prefix_share,
            "capacity_estimate": self.capacity_estimate,
        }

    def _call(self, verb: str, *args: Any) -> Any:
        """One call to the allocator, its time added to the step's."""
        fn = getattr(self.alloc, verb)
        t0 = time.perf_counter_ns()
        out = fn(*args)
        self.step_ns[-1] += time.perf_counter_ns() - t0
        return out

    def step(self) -> None:
        call, budget = self._call, self.args.budget
        scheduled: list[tuple[Turn, int]] = []
        preempted = False
        self.step_ns.append(0)
        call("step_starts")
        i = 0
        floor = self.args.min_chunk
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num = max(1, min(request.num_prompt - request.computed, budget))
            if num > floor:
                num = call("spare_chunk", request.index, num, floor)
            while call("extend", request.index, num) is None:
                if i < len(self.running) - 1:  # the newest other request makes room
                    self._preempt(self.running.pop())
                elif num > 1:
                    num //= 2
                else:
                    self._preempt(self.running.pop(i))
                    break
                preempted = True
            else:
                scheduled.append((request, num))
                budget -= num
                i += 1
        while not preempted and self.waiting and len(self.running) < self.args.in_flight:
            request = self.waiting[0]
            hit = call("lookup", request.index)
            num = min(request.num_prompt - hit, budget)
            if num > floor:
                num = call("spare_chunk", request.index, num, floor)
            if num <= 0 or call("admit", request.index, num, True) is None:
                break
            self.waiting.popleft()
            if request.index not in self.admitted:  # a turn's first admission counts
                self.admitted.add(request.index)
                self.per_turn[request.turn][0] += hit
                self.per_turn[request.turn][1] += request.num_prompt
            request.computed = hit
            self.running.append(request)
            scheduled.append((request, num))
            budget -= num
        self._apply(scheduled)

    def _apply(self, scheduled: list[tuple[Turn, int]]) -> None:
        """The step ran: computed tokens advance; a request at its end samples a token."""
        done: list[Turn] = []
        for request, num in scheduled:
            request.computed += num
            if request.computed < request.num_prompt:
                continue  # prefill goes on
            reply = request.session.replies[request.turn]  # known in advance
            self._call("append", request.index, reply[request.num_generated])
            request.num_generated += 1
            if request.num_generated == len(reply):
                done.append(request)
        for request in done:
            self._call("free", request.index, False)
            self.running.remove(request)
            if request.turn + 1 < self.args.turns:
                self.waiting.append(self._turn(request.session, request.turn + 1))

    def _preempt(self, request: Turn) -> None:
        """Free a running request; it is recomputed later, its reply so far included."""
        self._call("free", request.index, True)
        request.num_prompt = len(request.session.prompt(request.turn)) + request.num_generated
        request.computed = 0
        self.num_preemptions += 1
        self.waiting.appendleft(request)


def allocators(args: argparse.Namespace) -> dict[str, Any]:
    """Name -> factory(groups, num_blocks) of each allocator to run."""
    kw = {"max_model_len": 1 << 20, "hash_name": "sha256", "reserve_full_isl": False}
    out: dict[str, Any] = {
        "hybridkv": lambda groups, num: OursAllocator(groups, num, BLOCK_SIZE, **kw)
    }
    if args.reference_src:
        import _vllm_reference

        vllm = _load_reference(args.reference_src)
        out[f"vLLM {vllm.version}"] = lambda groups, num: _vllm_reference.ReferenceAllocator(
            vllm, groups, num, BLOCK_SIZE, **kw
        )
    return out


@functools.cache
def _load_reference(src: str) -> Any:
    """vLLM's modules from ``src``, imported once (both working-set definitions use them)."""
    import _vllm_reference

    return _vllm_reference.load(src)


def measure(make: Any, groups: list[dict[str, Any]], occupancy: float, args: Any) -> Any:
    """The hit rates of one run (they never vary); the times, the best of the repeats."""
    runs = [Run(make, groups, occupancy, args).run() for _ in range(args.repeats)]
    best = min(runs, key=lambda r: r["step_us_mean"])
    best["step_us_means"] = [r["step_us_mean"] for r in runs]
    return best


def main() -> None:
    args = parse_args()
    print(
        f"{args.sessions} sessions x {args.turns} turns round-robin, {args.in_flight} in flight;"
        f" system prompt {args.system_tokens} tokens, messages {args.user_tokens[0]}-"
        f"{args.user_tokens[1]}, replies {args.reply_tokens[0]}-{args.reply_tokens[1]};"
        f" block {BLOCK_SIZE}, window {WINDOW}, {args.budget} tokens a step"
    )
    definitions = ("peak", "mean") if args.working_set == "both" else (args.working_set,)
    out = {}
    for definition in definitions:
        args.definition = definition
        print(f"\n== working set: {definition}")
        out[definition] = report(args)
    print(json.dumps(out, separators=(",", ":")))
    workload = {
        key: getattr(args, key)
        for key in ("sessions", "turns", "system_tokens", "user_tokens", "reply_tokens",
                    "in_flight", "budget", "min_chunk", "repeats", "seed", "occupancy")
    }  # fmt: skip
    workload |= {"block_size": BLOCK_SIZE, "window": WINDOW}
    write_json(args.json, {"workload": workload, "working_sets": out})


def report(args: argparse.Namespace) -> dict[str, dict[str, dict[str, Any]]]:
    """Every allocator and layout at every occupancy, under ``args.definition``; printed."""
    occ = [str(o) for o in args.occupancy]
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for name, make in allocators(args).items():
        for layout, groups in LAYOUTS.items():
            row = {str(o): measure(make, groups, o, args) for o in args.occupancy}
            results[f"{layout}, {name}"] = row
    width = max(*map(len, results), *(len(f"{lay}, capacity estimate") for lay in LAYOUTS)) + 2
    head = f"{'occupancy':<{width}}" + "".join(f"{o:>8}" for o in occ)
    print(f"prefix hit rate over turns 2-{args.turns}\n{head}")
    for label, row in results.items():
        print(f"{label:<{width}}" + "".join(f"{row[o]['hit_rate']:>8.3f}" for o in occ))
    full, hybrid = (results[f"{layout}, hybridkv"] for layout in LAYOUTS)
    gaps = "".join(f"{full[o]['hit_rate'] - hybrid[o]['hit_rate']:>8.3f}" for o in occ)
    print(f"{'full minus hybrid, hybridkv':<{width}}{gaps}")
    for layout, row in zip(LAYOUTS, (full, hybrid), strict=True):
        label = f"{layout}, capacity estimate"
        print(f"{label:<{width}}" + "".join(f"{row[o]['capacity_estimate']:>8.3f}" for o in occ))
    print(f"\nallocator us per step, mean over steps (best of {args.repeats} runs)\n{head}")
    for label, row in results.items():
        print(f"{label:<{width}}" + "".join(f"{row[o]['step_us_mean']:>8.1f}" for o in occ))
    print(f"\npreemptions\n{head}")
    for label, row in results.items():
        print(f"{label:<{width}}" + "".join(f"{row[o]['preemptions']:>8}" for o in occ))
    if args.per_turn:
        print("\nsessions' prefixes after each turn, in pages, over the peak working set")
        for layout in LAYOUTS:
            row = next(r for label, r in results.items() if label.startswith(layout + ","))
            shares = " ".join(f"{x:.2f}" for x in row[occ[0]]["prefix_share"])
            print(f"{layout:<{width}} {'':>5}  {shares}")
        print("\nhit rate per turn")
        for label, row in results.items():
            for o in occ:
                turns = " ".join(f"{h:.2f}" for h in row[o]["per_turn"][1:])
                print(f"{label:<{width}} {o:>5}  {turns}")
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``, or ``sys.argv``); ``parse_args([])``: the defaults."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--occupancy", type=float, nargs="+", default=list(OCCUPANCIES))
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--user-tokens", type=int, nargs=2, default=(50, 150), metavar=("MIN", "MAX"))
    p.add_argument("--reply-tokens", type=int, nargs=2, default=(100, 300), metavar=("MIN", "MAX"))
    p.add_argument("--in-flight", type=int, default=4, help="requests running at once")
    p.add_argument("--budget", type=int, default=2048, help="tokens a step (prefill chunk)")
    p.add_argument(
        "--min-chunk",
        type=int,
        default=attrs.fields(EngineConfig).min_prefill_chunk.default,
        help="fewest tokens the planner shortens a prefill chunk to, sparing kept prefixes "
        "(EngineConfig.min_prefill_chunk; a budget or more turns it off)",
    )
    p.add_argument("--repeats", type=int, default=1, help="runs per cell; times: the best")
    p.add_argument("--per-turn", action="store_true", help="also print each turn's hit rate")
    p.add_argument("--reference-src", help="vLLM source tree (holding vllm/) to compare")
    p.add_argument(
        "--working-set",
        choices=("peak", "mean", "both"),
        default="both",
        help="what occupancy 1.0 holds: every session at its longest (peak), or the "
        "sessions' resumable prefixes averaged over the turns (mean: equal pressure)",
    )
    p.add_argument("--seed", type=int, default=0)
    add_json_argument(p)
    args = p.parse_args(argv)
    args.definition = "peak" if args.working_set == "both" else args.working_set
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    return args


if __name__ == "__main__":
    main()
