"""The simulation of routing.py: chats routed over simulated replicas in modelled time,
the router reading each replica's KV events a step late.

Each replica (``routing/replica.py``) steps at its own pace, a step lasting what it
computes; a turn arrives (a chat's start, or its previous reply's end plus a think time)
and is routed at once, on the replicas' loads now and on what their indexes hold::

    replica a   |--- step ---|- step -|--------- step (prefill) ---------|- step -|
    replica b   |- step -|- step -|- step -|   idle   |--- step ---|
    arrivals       ^ routed on loads now and on the events of a's and b's steps
                     before their latest one

A step's events reach the replica's ``ReplicaIndex`` when its next step ends (or a base
step's time later, if none follows): a router reads every replica's blocks one step
late, as it would over ZMQ.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
import time
from typing import Any

from benchmarks.routing.replica import SimReplica
from benchmarks.routing.workload import Chat, Turn
from hybridkv.serving.router.ranking import Router

_ARRIVE, _STEP_END, _EVENTS = range(3)


class Simulation:
    """Chats routed over replicas in modelled time, until every turn is answered.

    Args:
        chats: The sessions.
        replicas: Per name, a replica.
        router: Ranks the replicas for each turn (None: one replica, nothing to route).
    """

    def __init__(
        self, chats: list[Chat], replicas: dict[str, SimReplica], router: Router | None
    ) -> None:
        if router is None and len(replicas) != 1:
            raise ValueError(f"{len(replicas)} replicas need a router")
        self.replicas = replicas
        self.router = router
        self._heap: list[tuple[float, int, int, Any]] = []
        self._tie = itertools.count()
        for chat in chats:
            self._push(chat.start_ms, _ARRIVE, (chat, 0))
        self.ttft_ms: list[float] = []
        self.route_ns = 0
        self.num_routed = 0
        self.end_ms = 0.0

    def _push(self, at_ms: float, kind: int, item: Any) -> None:
        heapq.heappush(self._heap, (at_ms, next(self._tie), kind, item))

    def run(self) -> dict[str, Any]:
        """Serve every turn; the measures of the run (see :func:`summary`)."""
        heap = self._heap
        while heap:
            now, _, kind, item = heapq.heappop(heap)
            if kind == _ARRIVE:
                chat, turn = item
                self._route(Turn(chat, turn, now), now)
            elif kind == _STEP_END:
                self._step_end(item, now)
            else:
                item.apply_pending()
        return self.summary()

    def _route(self, request: Turn, now: float) -> None:
        if self.router is None:
            replica = next(iter(self.replicas.values()))
        else:
            loads = {name: r.load() for name, r in self.replicas.items()}
            t0 = time.perf_counter_ns()
            best = self.router.rank(request.all_token_ids, loads, self.replicas)[0]
            self.router.sent(best, request.all_token_ids)
            self.route_ns += time.perf_counter_ns() - t0
            self.num_routed += 1
            replica = self.replicas[best]
        replica.waiting.append(request)
        if not replica.is_busy:
            self._start(replica, now)

    def _start(self, replica: SimReplica, now: float) -> None:
        duration = replica.plan()
        if duration:
            self._push(now + duration, _STEP_END, replica)
        elif replica.pending is not None:  # idle: its events go out a base step later
            # (before any later step of it ends: a step lasts at least that long).
            self._push(now + replica.spec.step_ms, _EVENTS, replica)

    def _step_end(self, replica: SimReplica, now: float) -> None:
        self.end_ms = now
        for request in replica.finish(now):
            assert request.first_token_ms is not None
            self.ttft_ms.append(request.first_token_ms - request.arrival_ms)
            chat, turn = request.chat, request.turn
            if turn + 1 < chat.num_turns:
                self._push(now + chat.think_ms[turn], _ARRIVE, (chat, turn + 1))
        replica.publish(now)
        self._start(replica, now)

    def summary(self) -> dict[str, Any]:
        """Hit rate (cached over prompt tokens at each turn's first admission), TTFT in
        modelled ms, load imbalance (the most tokens a replica computed over the mean),
        and what shows how loaded the replicas were."""
        reps = list(self.replicas.values())
        computed = [r.num_computed for r in reps]
        ttft = sorted(self.ttft_ms)
        deciles = statistics.quantiles(ttft, n=10, method="inclusive")
        return {
            "hit_rate": round(sum(r.num_hit for r in reps) / sum(r.num_prompt for r in reps), 4),
            "ttft_ms_mean": round(statistics.fmean(ttft), 1),
            "ttft_ms_p50": round(statistics.median(ttft), 1),
            "ttft_ms_p90": round(deciles[8], 1),
            "imbalance": round(max(computed) / statistics.fmean(computed), 3),
            "num_turns": len(ttft),
            "preemptions": sum(r.num_preemptions for r in reps),
            "busy": round(statistics.fmean(r.busy_ms for r in reps) / self.end_ms, 3),
            "batch_mean": round(
                sum(r.num_scheduled for r in reps) / max(1, sum(r.num_steps for r in reps)), 2
            ),
            "route_us": round(self.route_ns / max(1, self.num_routed) / 1000, 1),
            "end_s": round(self.end_ms / 1000, 1),
        }
