"""The chats of multisession.py and one run of them: sessions, turns, the layouts, the
pages a prefix needs, and the capacity bound a pool of pages allows."""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections import deque
from typing import Any

from hybridkv.memory import KVCacheManager
from hybridkv.policies import FullAttention, MemoryPolicy, SlidingWindow

BLOCK_SIZE = 16
WINDOW = 1024
LAYOUTS: dict[str, list[dict[str, Any]]] = {
    "full": [{"type": "full"}],
    "1 full + 5 sliding": [{"type": "full"}]
    + [{"type": "sliding_window", "sliding_window": WINDOW}] * 5,
}
#: gpt-oss's layers: sliding (window 128) and full alternating, one group of each.
GPT_OSS: dict[str, list[dict[str, Any]]] = {
    "gpt-oss, 1 full + 1 sliding (128)": [
        {"type": "full"},
        {"type": "sliding_window", "sliding_window": 128},
    ]
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
