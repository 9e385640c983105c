"""The engine core: every request's state, and the synchronous half of each step.

The async :class:`~hybridkv.scheduler.engine.Engine` drives it from one event-loop thread::

    add_request / abort          any time, from the loop thread (also while steps run)
    plan()  -> StepPlan          admit, preempt, allocate (step_planner.py); may be called
                                 again while earlier plans are in flight (in_flight.py)
    apply(plan, result)          the executor returned: append tokens, stop requests
    fail(plan, error)            the executor raised: fail the step's requests
    flush()                      deliver the outputs gathered by apply/fail to the sinks,
                                 publish the KV events (outbox.py)
    shutdown(error)              end every live request, free every block

Steps in flight form a queue: ``apply`` and ``fail`` take the oldest, in order. A request
is in at most one step in flight (the planner skips requests whose step has not been
applied), and it keeps its blocks until that step is applied or failed, even if aborted.

``apply`` and ``fail`` only gather outputs; the engine flushes them once the next step is
on its way, so consumers run while the executor does. ``abort`` and ``shutdown`` flush at
once. Nothing here awaits, so tests drive it directly, without a loop.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

import attrs

from hybridkv.errors import HybridKVError
from hybridkv.errors.events import get_logger
from hybridkv.memory.cache_events import CacheEventSink
from hybridkv.memory.hashing import TOKEN_ID_LIMIT
from hybridkv.memory.manager import KVCacheManager
from hybridkv.memory.offload.config import OffloadConfig
from hybridkv.memory.offload.keys import KeySpace
from hybridkv.scheduler.batch import ExecutorResultError, StepResult
from hybridkv.scheduler.config import EngineConfig
from hybridkv.scheduler.connector import EngineOffload, NoOffload
from hybridkv.scheduler.errors import RequestFailedError
from hybridkv.scheduler.in_flight import StepsInFlight
from hybridkv.scheduler.meter import PrefixCounter, ThroughputMeter
from hybridkv.scheduler.outbox import Outbox
from hybridkv.scheduler.outputs import EngineStats, FinishReason, TokenLogprobs
from hybridkv.scheduler.params import InvalidRequestError, SamplingParams
from hybridkv.scheduler.queue import WaitingQueue
from hybridkv.scheduler.request import OutputSink, Request, RequestStatus
from hybridkv.scheduler.results import check_result, gather_prompt_logprobs, request_failure
from hybridkv.scheduler.speculation import Proposer
from hybridkv.scheduler.speculator import Speculator
from hybridkv.scheduler.step_costs import StepCosts
from hybridkv.scheduler.step_planner import StepPlan, plan_step, share_of_ready
from hybridkv.scheduler.validation import check_request, never_fits

log = get_logger(__name__)


class EngineCore:
    """Requests, queues and the KV cache manager of one engine. Not thread-safe."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_steps_in_flight: int = 1,
        offload: tuple[OffloadConfig, KeySpace] | None = None,
        proposer: Proposer | None = None,
        kv_events: CacheEventSink | None = None,
        step_costs: StepCosts | None = None,
    ):
        self.config = config
        self.max_steps_in_flight = max_steps_in_flight
        caching = config.enable_prefix_caching
        self.kv = KVCacheManager.for_pool(config.pool, enable_prefix_caching=caching)
        # With a KV connector: loads and saves through offload tiers (connector.py);
        # the core calls the seam alike either way.
        self.offload = EngineOffload(*offload, self.kv) if offload else None
        self._transfers: EngineOffload | NoOffload = self.offload or NoOffload()
        self.speculator = Speculator.for_engine(config, proposer, step_costs)
        self.waiting = WaitingQueue()
        self.running: list[Request] = []  # sorted by (priority, arrival)
        self._requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._clock = clock
        self._has_finished_running = False
        self._in_flight = StepsInFlight()
        # Deliveries and KV events gathered since the last flush.
        tiers = offload[0].tiers if offload else ()
        self._outbox = Outbox(self.kv, kv_events, tiers)
        self._plan_us = 0.0
        self._meter = ThroughputMeter()
        self._prefix = PrefixCounter()
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_finished = 0

    # -- requests ----------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        """Whether a step could run something."""
        self._prune_running()
        return bool(self.running) or bool(self.waiting) or self._transfers.has_transfers

    @property
    def num_steps_in_flight(self) -> int:
        """Planned steps whose results have not been applied (or failed) yet."""
        return len(self._in_flight)

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        sink: OutputSink,
        *,
        request_id: str,
        priority: int = 0,
        extra_keys: tuple[object, ...] = (),
        speculative: bool = True,
    ) -> Request:
        """Validate and queue a request; raise at once if it is malformed or cannot be taken.

        Raises:
            InvalidRequestError: empty prompt, bad token ids, duplicate request id, a
                priority the scheduling policy does not take.
            PromptTooLongError: the sequence exceeds ``max_model_len`` or the whole pool.
            EngineOverloadedError: ``max_waiting`` requests wait already.
        """
        self.config.check_priority(priority)
        prompt = check_request(prompt_token_ids, params, self.config, self.kv)
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.waiting.check_room(self.config.max_waiting)
        request = Request(
            request_id,
            prompt,
            params,
            arrival_seq=next(self._arrivals),
            arrival_time=self._clock(),
            sink=sink,
            log=log.bind(request_id=request_id),
            priority=priority,
            extra_keys=extra_keys,
            speculative=speculative,
        )
        self._requests[request_id] = request
        self.waiting.push(request)
        return request

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """End a request now; its pages are freed now, or after the step running it.

        Returns False if no live request has that id (finished already, or unknown).
        """
        request = self._requests.get(request_id)
        if request is not None:
            self.end(request, reason)
        return request is not None

    def end(self, request: Request, reason: FinishReason) -> None:
        """Like :meth:`abort`, for a request object (a no-op if it has finished)."""
        self._finish(request, reason)
        self.flush()

    # -- steps -------------------------------------------------------------------------

    def plan(self) -> StepPlan:
        """Plan the next step (see :func:`~hybridkv.scheduler.step_planner.plan_step`).

        A plan that schedules anything is in flight until :meth:`apply` or :meth:`fail`
        takes it; requests of earlier steps in flight are not in it.
        """
        start = time.perf_counter()
        self._prune_running()
        free_steps = self.max_steps_in_flight - len(self._in_flight)
        cap = share_of_ready(self.running, self.waiting, free_steps)
        loader, speculator = self._transfers.loader, self.speculator
        plan = plan_step(self.running, self.waiting, self.kv, self.config, cap, loader, speculator)
        transfers = self._transfers.take_transfers()
        if transfers is not None:
            plan = attrs.evolve(plan, batch=attrs.evolve(plan.batch, transfers=transfers))
        now = self._clock()
        plan = plan if self.speculator is None else attrs.evolve(plan, planned_at=now)
        for request in plan.rejected:
            error = never_fits(request.request_id, len(request.all_token_ids), self.kv)
            self._finish(request, error=error)
        for request in plan.preempted:
            self.num_preemptions += 1
            request.log_preempted(self.kv.num_free_blocks)
        for request in plan.admitted:
            if request.admitted(now) and self.config.enable_prefix_caching:
                self._prefix.record(request.num_cached_tokens, request.num_prompt_tokens)
        if plan.runs:
            self._in_flight.push(plan)
        self._plan_us = (time.perf_counter() - start) * 1e6
        return plan

    def apply(self, plan: StepPlan, result: StepResult) -> None:
        """Apply the oldest step's result: append tokens, end finished requests, and
        gather the outputs for :meth:`flush`. A malformed result fails the step."""
        start = time.perf_counter()
        problem = check_result(plan, result, self.config.vocab_size or TOKEN_ID_LIMIT)
        if problem is not None:
            self.fail(plan, ExecutorResultError(problem))
            return
        self._in_flight.pop(plan)
        now = self._clock()
        for again in self._transfers.apply_loads(result.kv_loads, now, self._prefix):
            self.waiting.push(again)  # its load failed: it resumes a shorter prefix
            self._has_finished_running = True
        transfers, kv_free = self._transfers, self.kv.free
        eos, max_len = self.config.eos_token_ids, self.config.max_model_len
        num_outputs = 0
        items = plan.batch.requests
        # This loop runs once per request per step: absent columns are repeat(None), and
        # _check_result has matched every present column's length to the batch.
        has_failures = bool(result.errors) or self._in_flight.has_stale
        for index, request, item, token, prompt_found, found in zip(
            itertools.count(),
            plan.scheduled,
            items,
            result.token_ids,
            result.prompt_logprobs or itertools.repeat(None),
            result.logprobs or itertools.repeat(None),
            strict=False,
        ):
            request.in_step = False
            if request.status is RequestStatus.FINISHED:  # aborted while the step ran
                kv_free(request.request_id)
                continue
            if has_failures or token is None:
                is_stale = self._in_flight.take_stale(request)
                error = request_failure(item, result, token, is_stale)
                if error is not None:
                    self._fail_request(request, error, computed=False)
                    continue
            if item.num_draft_tokens:  # speculative decoding: scheduler/verified.py
                assert self.speculator is not None, "a proposal without a speculator"
                verified = self.speculator.take(request, item, (result, index), self.kv)
                if isinstance(verified, HybridKVError):
                    self._fail_request(request, verified, computed=False)
                    continue
                transfers.filled(request, item.start_position)
                tokens, reason, logprobs = verified.tokens, verified.reason, verified.logprobs
            else:
                request.num_computed_tokens += len(item.token_ids)
                transfers.filled(request, item.start_position)
                if prompt_found:
                    gather_prompt_logprobs(request, item, prompt_found)
                if token is None:
                    continue
                logprobs = None
                if request.params.logprobs is not None:
                    if found is None:
                        error = ExecutorResultError("the executor returned no logprobs for it")
                        self._fail_request(request, error, computed=True)
                        continue
                    logprobs = (found,)
                request.all_token_ids.append(token)
                tokens, reason = (token,), request.stop_reason(token, eos, max_len)
            num_outputs += len(tokens)
            if result.proposals is not None:  # the MTP layer's, for the next step
                request.proposed = (len(request.all_token_ids), result.proposals[index])
            if request.first_token_time is None:
                request.first_token_time = now
            if reason is None:
                self._outbox.append((request, request.output(tokens, None, logprobs), False))
            else:
                self._finish(request, reason, new_token_ids=tokens, logprobs=logprobs)
        self.num_steps += 1
        if self.speculator is not None:
            self.speculator.step_done(items, now - plan.planned_at)
        self._meter.record(now, plan.num_tokens, num_outputs)
        apply_us = (time.perf_counter() - start) * 1e6
        log.debug(
            "step",
            num_requests=len(plan.scheduled),
            num_tokens=plan.num_tokens,
            num_admitted=len(plan.admitted),
            num_preempted=len(plan.preempted),
            num_in_flight=len(self._in_flight),
            plan_us=round(self._plan_us, 1),
            apply_us=round(apply_us, 1),
        )

    def fail(self, plan: StepPlan, error: BaseException) -> None:
        """The executor raised for the oldest step: fail its requests, free their blocks.

        Requests of later steps in flight that were admitted on a prefix-cache hit fail
        too when their step returns: the hit may name blocks this step was to fill.
        """
        self._in_flight.pop(plan)
        log.warning("step_failed", num_requests=len(plan.scheduled), error=repr(error))
        for request in plan.scheduled:
            request.in_step = False
            if request.status is RequestStatus.FINISHED:  # aborted while the step ran
                self.kv.free(request.request_id, computed=False)
            else:
                self._fail_request(request, error, computed=False)
        self._in_flight.failed()
        self.num_steps += 1

    def shutdown(self, error: HybridKVError | None = None) -> None:
        """End every live request (with ``error``, or finish reason SHUTDOWN).

        Call it only when the executor is not running a step: a planned step whose result
        was never applied counts as not run.
        """
        for plan in self._in_flight.drain():
            for request in plan.scheduled:
                if request.in_step:
                    request.in_step = False
                    self.kv.free(request.request_id, computed=False)
        for request in self._transfers.loading_requests():
            request.in_step = False
            self.kv.free(request.request_id, computed=False)
        self._transfers.close()
        for request in list(self._requests.values()):
            self._finish(request, None if error else FinishReason.SHUTDOWN, error=error)
        self._prune_running()
        self.flush()

    def flush(self) -> None:
        """Deliver the gathered outputs, in order (a sink's last item closes it), and
        publish the KV events gathered since the last flush."""
        self._outbox.flush(lambda request: self._finish(request, FinishReason.ABORT))

    # -- finishing ---------------------------------------------------------------------

    def _fail_request(self, request: Request, error: BaseException, *, computed: bool) -> None:
        failure = RequestFailedError(f"request {request.request_id!r} failed: {error!r}")
        failure.__cause__ = error
        self._finish(request, error=failure, computed=computed)

    def _finish(
        self,
        request: Request,
        reason: FinishReason | None = None,
        *,
        error: HybridKVError | None = None,
        new_token_ids: tuple[int, ...] = (),
        logprobs: tuple[TokenLogprobs, ...] | None = None,
        computed: bool = True,
    ) -> None:
        """End a live request: leave its queue, free its pages unless a step holds them.

        ``computed`` is passed to :meth:`KVCacheManager.free`: False when the request's
        latest allocation belongs to a step that failed.
        """
        status = request.status
        if status is RequestStatus.FINISHED:
            return  # already ended (its pages wait for the step in flight)
        if status is RequestStatus.WAITING:
            self.waiting.discard(request)
        elif not request.in_step:
            if computed:
                self._transfers.ended(request)  # its pages are still held: read next step
            self.kv.free(request.request_id, computed=computed)
            self._has_finished_running = True
        else:
            self._has_finished_running = True  # freed when the step returns
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._transfers.drop(request)
        del self._requests[request.request_id]
        self.num_finished += 1
        item = error if error is not None else request.output(new_token_ids, reason, logprobs)
        self._outbox.append((request, item, True))
        request.log_finished(reason, error, self._clock())

    def _prune_running(self) -> None:
        if self._has_finished_running:
            self.running[:] = [r for r in self.running if r.status is RequestStatus.RUNNING]
            self._has_finished_running = False

    def stats(self) -> EngineStats:
        """Counts of the queues and the pool, prefix hit rate, recent throughput."""
        self._prune_running()
        usage = self.kv.usage()
        tokens_per_second, output_tokens_per_second = self._meter.rates(self._clock())
        return EngineStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_preempted=sum(1 for r in self.waiting if r.is_preempted),
            num_preemptions=self.num_preemptions,
            num_finished=self.num_finished,
            num_steps=self.num_steps,
            blocks_used_per_group=usage.blocks_used_per_group,
            num_free_blocks=usage.num_free_blocks,
            num_blocks=usage.num_blocks,
            prefix_hit_rate=self._prefix.hit_rate,
            tokens_per_second=tokens_per_second,
            output_tokens_per_second=output_tokens_per_second,
            num_kv_pages_used=usage.kv_pages_used,
            num_state_pages_used=usage.state_pages_used,
            num_free_state_pages=usage.num_free_state_pages,
            spec_decode=None if self.speculator is None else self.speculator.stats(),
        )
