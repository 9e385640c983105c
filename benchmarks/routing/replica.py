"""A simulated replica for routing.py: a KV cache manager planned step by step in
modelled time, its cache events encoded as a replica would publish them.

A replica is a ``KVCacheManager`` (no model) planned as multisession.py's loop plans it
(``_multisession_run.Run.step``: running requests first, chunked prefill within a token
budget, one token per decode, the newest other request preempted when one cannot grow;
then admissions in queue order, each with a prefix lookup). A step is planned when it
starts (its pages allocated) and applied when it ends (tokens advance, a request at its
end samples); it lasts ``step_ms + token_ms x tokens`` of modelled time.

Its pool reports cache events (``memory/cache_events.py``); each step's are encoded as a
``KVEventBatch`` (``parallel/kv_event_wire.py``) and held until the next step ends, when
they reach the index a router keeps of the replica (:meth:`SimReplica.publish`).
"""

from __future__ import annotations

from collections import deque

import attrs

from benchmarks.routing.workload import Layout, Turn
from hybridkv.memory.cache_events import CacheEventLog, GroupInfo
from hybridkv.memory.headroom import token_headroom
from hybridkv.parallel.kv_event_wire import encode_batch
from hybridkv.serving.router.index import ReplicaIndex
from hybridkv.serving.router.ranking import ReplicaLoad


@attrs.frozen(kw_only=True)
class ReplicaSpec:
    """One replica's pool, step limits and step cost.

    Attributes:
        num_blocks: Page ids of its pool (the null page included).
        budget: Tokens a step computes at most.
        max_running: Requests running at once at most.
        min_chunk: Fewest tokens a prefill chunk is shortened to, sparing kept prefixes.
        step_ms: Modelled cost of a step, whatever it computes.
        token_ms: Modelled cost of each token a step computes.
    """

    num_blocks: int
    budget: int
    max_running: int
    min_chunk: int
    step_ms: float
    token_ms: float

    def pooled(self, num_replicas: int) -> ReplicaSpec:
        """One engine with the pool, batch and compute of ``num_replicas`` of these."""
        return attrs.evolve(
            self,
            num_blocks=self.num_blocks * num_replicas,
            budget=self.budget * num_replicas,
            max_running=self.max_running * num_replicas,
            token_ms=self.token_ms / num_replicas,
        )


class SimReplica:
    """One replica: its allocator, queues, counters, and the index a router keeps of it.

    Args:
        layout: The KV groups.
        spec: Pool, limits and cost.
        index: Where its event batches go (None: no router reads them).
    """

    def __init__(self, layout: Layout, spec: ReplicaSpec, index: ReplicaIndex | None) -> None:
        self.spec = spec
        self.kv = layout.manager(spec.num_blocks)
        self.index = index
        if index is not None:
            bs = self.kv.block_size
            groups = [GroupInfo.of(g, p, bs) for g, p in enumerate(self.kv.policies)]
            self.kv.pool.events = CacheEventLog(groups)
        self.waiting: deque[Turn] = deque()
        self.running: list[Turn] = []
        self.scheduled: list[tuple[Turn, int]] = []  # the step under way
        self.pending: tuple[int, bytes] | None = None  # the latest step's events
        self.num_seq = 0
        # Counters: tokens computed, hit and prompt tokens at first admissions, ...
        self.num_computed = self.num_hit = self.num_prompt = 0
        self.num_preemptions = self.num_steps = self.num_scheduled = 0
        self.busy_ms = 0.0
        self._free_tokens: int | None = None  # the headroom, until the pool changes

    @property
    def is_busy(self) -> bool:
        return bool(self.scheduled)

    def load(self) -> ReplicaLoad:
        """Its queues and free pages, as its ``/load`` reports them (computed once per
        change of the pool: a step's start and end)."""
        if self._free_tokens is None:
            kv = self.kv
            limit = self.spec.num_blocks * kv.block_size
            self._free_tokens = token_headroom(kv, kv.num_free_blocks, limit)
        return ReplicaLoad(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            free_tokens=self._free_tokens,
        )

    def plan(self) -> float:
        """Plan a step (allocating its pages); its modelled duration (0: nothing to do)."""
        kv, spec = self.kv, self.spec
        budget, floor = spec.budget, spec.min_chunk
        self._free_tokens = None
        scheduled: list[tuple[Turn, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num = max(1, min(request.num_prompt - request.computed, budget))
            if num > floor:
                num = kv.spare_chunk(request, num, at_least=floor)
            while kv.allocate(request, num) is None:
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
        while not preempted and self.waiting and len(self.running) < spec.max_running:
            request = self.waiting[0]
            hit = kv.lookup(request)
            num = min(request.num_prompt - hit.num_tokens, budget)
            if num > floor:
                num = kv.spare_chunk(request, num, hit, at_least=floor)
            if num <= 0 or kv.allocate(request, num, hit) is None:
                break
            self.waiting.popleft()
            if not request.is_admitted:
                request.is_admitted = True
                self.num_hit += hit.num_tokens
                self.num_prompt += request.num_prompt
            request.computed = hit.num_tokens
            self.running.append(request)
            scheduled.append((request, num))
            budget -= num
        if not scheduled and self.waiting:
            request = self.waiting[0]
            raise RuntimeError(
                f"replica cannot admit request {request.request_id} of {request.num_prompt}"
                f" tokens with nothing running: {spec.num_blocks} page ids are too few"
            )
        self.scheduled = scheduled
        if not scheduled:
            return 0.0
        num_tokens = sum(num for _, num in scheduled)
        duration = spec.step_ms + spec.token_ms * num_tokens
        self.num_computed += num_tokens
        self.num_steps += 1
        self.num_scheduled += len(scheduled)
        self.busy_ms += duration
        return duration

    def finish(self, now_ms: float) -> list[Turn]:
        """The step under way ended at ``now_ms``: tokens advance, a request at its end
        samples a token; the requests whose replies ended, freed."""
        done: list[Turn] = []
        for request, num in self.scheduled:
            request.computed += num
            if request.computed < request.num_prompt:
                continue  # prefill goes on
            reply = request.reply
            request.all_token_ids.append(reply[request.num_generated])
            request.num_generated += 1
            if request.first_token_ms is None:
                request.first_token_ms = now_ms
            if request.num_generated == len(reply):
                done.append(request)
        for request in done:
            self.kv.free(request.request_id)
            self.running.remove(request)
        self.scheduled = []
        self._free_tokens = None
        return done

    def publish(self, now_ms: float) -> None:
        """The previous step's events reach the index; this step's are on their way."""
        self.apply_pending()
        log = self.kv.pool.events
        events = log.take() if log is not None else []
        if events:
            self.pending = (self.num_seq, encode_batch(now_ms / 1000, events))
            self.num_seq += 1

    def apply_pending(self) -> None:
        if self.pending is not None and self.index is not None:
            self.index.apply(*self.pending)
        self.pending = None

    def _preempt(self, request: Turn) -> None:
        """Free a running request; it is recomputed later, its reply so far included."""
        self.kv.free(request.request_id)
        request.num_prompt = len(request.all_token_ids)
        request.computed = 0
        self.num_preemptions += 1
        self.waiting.appendleft(request)
